// The workers' disk tier on real processes (a cache store, 1 prefill and 1 decode worker with 8
// DRAM cache slots each, a gateway; the prefill worker with a disk tier behind its DRAM, the
// decode worker without, so its copies do not serve the prompts these cases read from the
// prefill worker's disk):
//  - a prompt whose blocks were pushed out of DRAM by other prompts comes back from the prefill
//    worker's disk (prefix_source "disk"), with the co-located reference's tokens; its TTFT is
//    printed next to a cold request's and a DRAM hit's;
//  - a byte flipped in the tier's file is detected on read and the block recomputed (tokens
//    still right, kvrelay:disk_tier_corrupt_blocks_total counts it);
//  - after kill -9 and a restart of the prefill worker (same node id, new incarnation), its
//    disk blocks are used again, only after the restart scan verified them;
//  - a disk that fails reads (its file cut short) and a disk too small for the tier (a 64 KiB
//    tmpfs) stop it with a log line and a metric while the worker serves on from DRAM;
//  - with a disk tier on both workers (`kvrelay up --ssd-dir`, a second cluster), a
//    conversation's next turn held on the decode worker's disk is promoted there before the
//    Reserve and pulled by the prefill worker.

#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/hf_config.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/local_cluster.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::e2e {
using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;

namespace {

constexpr absl::Duration kRequestTimeout = absl::Seconds(60);
constexpr int kCacheSlots = 8;
constexpr int64_t kSsdBytes = 64 << 20;

class DiskTier : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    model_dir_ = dir_->File("llama");
    ssd_dir_ = dir_->File("ssd");
    std::filesystem::create_directories(ssd_dir_ + "/prefill-0");
    ASSERT_TRUE(WriteModel(model_dir_, "llama").ok());
    absl::StatusOr<kv::ModelConfig> config = kv::LoadHfConfig(model_dir_ + "/config.json", {});
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = new kv::ModelConfig(*config);
    absl::StatusOr<std::unique_ptr<cli::ColocatedGenerator>> reference =
        cli::ColocatedGenerator::Load(model_dir_, 1, {.kind = model::DeviceChoice::Kind::kCpu});
    ASSERT_TRUE(reference.ok()) << reference.status();
    reference_ = reference->release();
    absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = StartCluster(/*decode_disk=*/false);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
  }
  // With `decode_disk` both workers get a disk tier (under ssd_dir_/both), else the prefill
  // worker alone (ssd_dir_/prefill-0).
  static absl::StatusOr<std::unique_ptr<LocalCluster>> StartCluster(bool decode_disk) {
    ClusterOptions options;
    options.model_dir = model_dir_;
    options.prefill = 1;
    options.decode = 1;
    options.worker_args = absl::StrCat(kPatientStoreCalls, " --cache-slots ", kCacheSlots);
    options.extra_args = {"--cachestore-args", "--node-ttl 3s --policy leaf-lru", "--gateway-args",
                          "--prefill-timeout 10s"};
    if (decode_disk) {
      options.extra_args.insert(options.extra_args.end(), {"--ssd-dir", ssd_dir_ + "/both",
                                                           "--ssd-bytes", absl::StrCat(kSsdBytes)});
    } else {
      options.extra_args.insert(
          options.extra_args.end(),
          {"--prefill-args",
           absl::StrCat("--ssd-dir ", ssd_dir_, "/prefill-0 --ssd-bytes ", kSsdBytes)});
    }
    return LocalCluster::Start(options);
  }
  static void TearDownTestSuite() {
    delete restarted_;
    delete both_;
    delete cluster_;
    delete reference_;
    delete config_;
    delete dir_;
  }

  static uint64_t SlotBytes() {
    uint64_t bytes = 0;
    for (size_t g = 0; g < config_->layout.groups().size(); ++g) {
      bytes += static_cast<uint64_t>(config_->layout.BlockBytes(static_cast<int>(g)));
    }
    return 4096 + (bytes + 4095) / 4096 * 4096;
  }
  static GatewayRequest Request(std::vector<int32_t> tokens) {
    GatewayRequest r;
    r.generation.tokens = std::move(tokens);
    r.generation.max_tokens = 6;
    r.tenant = "disk";
    return r;
  }
  static std::vector<int32_t> Reference(const GatewayRequest& r) {
    absl::StatusOr<cli::GenerationResult> expected = reference_->Generate(r.generation);
    EXPECT_TRUE(expected.ok()) << expected.status();
    return expected.ok() ? expected->tokens : std::vector<int32_t>{};
  }
  static absl::StatusOr<cli::GenerationResult> Generate(const GatewayRequest& r,
                                                        LocalCluster* cluster = cluster_) {
    GatewayClient client(cluster->gateway());
    return client.Generate(r, kRequestTimeout);
  }
  // Prompts of 6 full blocks each, 4 of them: 24 blocks through 8 DRAM slots on each worker.
  static void PushOutOfDram(uint32_t seed, LocalCluster* cluster = cluster_) {
    for (uint32_t i = 0; i < 4; ++i) {
      const GatewayRequest r = Request(RandomPrompt(100, seed + i));
      absl::StatusOr<cli::GenerationResult> out = Generate(r, cluster);
      ASSERT_TRUE(out.ok()) << out.status() << cluster->Log();
      EXPECT_EQ(out->tokens, Reference(r));
    }
  }
  // Until the store lists as many disk blocks as the workers' tiers hold (each worker announces
  // its tier's changes within about 100 ms): what the next request's routing sees.
  static void WaitForDiskAnnounced(LocalCluster* cluster) {
    KV_ASSERT_OK_AND_ASSIGN(ServiceInfo store, cluster->Service("cachestore"));
    double on_disks = 0, listed = -1;
    for (int i = 0; i < 100 && on_disks != listed; ++i) {
      if (i > 0) absl::SleepFor(absl::Milliseconds(50));
      on_disks = 0;
      for (const char* name : {"prefill-0", "decode-0"}) {
        KV_ASSERT_OK_AND_ASSIGN(ServiceInfo worker, cluster->Service(name));
        on_disks += ScrapeMetric(worker.metrics_address, "kvrelay:disk_tier_blocks").value_or(0);
      }
      listed =
          ScrapeMetric(store.metrics_address, "kvrelay:cachestore_tier_used_slots{tier=\"ssd\"}")
              .value_or(-1);
    }
    ASSERT_EQ(on_disks, listed) << "the store did not list the workers' disk blocks";
  }
  static std::string PrefillMetrics() {
    if (restarted_metrics_.empty()) {
      absl::StatusOr<ServiceInfo> prefill = cluster_->Service("prefill-0");
      return prefill.ok() ? prefill->metrics_address : "";
    }
    return restarted_metrics_;
  }
  static std::string TierFile() {
    for (const auto& entry : std::filesystem::directory_iterator(ssd_dir_ + "/prefill-0")) {
      if (entry.path().extension() == ".tier") return entry.path().string();
    }
    return "";
  }

  // kill -9 of prefill-0 (the cluster's, or the one restarted earlier) and a new process with the
  // same node id on the same port with its disk tier in `ssd_dir`; returns once the gateway
  // routes through it again.
  static void RestartPrefill(const std::string& ssd_dir) {
    KV_ASSERT_OK_AND_ASSIGN(ServiceInfo prefill, cluster_->Service("prefill-0"));
    KV_ASSERT_OK_AND_ASSIGN(ServiceInfo store, cluster_->Service("cachestore"));
    if (restarted_ != nullptr) {
      restarted_->Signal(SIGKILL);
      (void)restarted_->Wait(absl::Seconds(10));
      delete restarted_;
      restarted_ = nullptr;
    } else {
      ASSERT_EQ(::kill(prefill.pid, SIGKILL), 0);
    }
    const std::string port = prefill.address.substr(prefill.address.rfind(':') + 1);
    absl::StatusOr<std::unique_ptr<testing::ChildProcess>> restarted =
        testing::ChildProcess::Start({testing::BinaryPath("kvrelay"),
                                      "prefill",
                                      "--insecure",
                                      "--host",
                                      "127.0.0.1",
                                      "--port",
                                      port,
                                      "--metrics-port",
                                      "0",
                                      "--cachestore",
                                      store.address,
                                      "--model",
                                      model_dir_,
                                      "--node-id",
                                      "prefill-0",
                                      "--device",
                                      "cpu",
                                      "--cache-slots",
                                      absl::StrCat(kCacheSlots),
                                      "--store-request-timeout",
                                      "5s",
                                      "--ssd-dir",
                                      ssd_dir,
                                      "--ssd-bytes",
                                      absl::StrCat(kSsdBytes)});
    ASSERT_TRUE(restarted.ok()) << restarted.status();
    restarted_ = restarted->release();
    absl::StatusOr<std::string> listening =
        restarted_->WaitForOutput("listening on", absl::Seconds(60));
    ASSERT_TRUE(listening.ok()) << listening.status() << restarted_->Stderr();
    // "prefill listening on HOST:PORT metrics HOST:PORT": the metrics address follows "metrics ".
    const std::string out = restarted_->Stdout();
    const size_t at = out.find("metrics ");
    ASSERT_NE(at, std::string::npos) << out;
    restarted_metrics_ = out.substr(at + 8, out.find_first_of(" \n", at + 8) - (at + 8));
    // The gateway finds the worker again (its breaker half-opens); unrelated prompts until one
    // goes through a prefill worker, so the next one under test does too.
    absl::StatusOr<cli::GenerationResult> warm;
    for (int i = 0; i < 40; ++i) {
      const GatewayRequest probe = Request(RandomPrompt(40, 1100 + static_cast<uint32_t>(i)));
      warm = Generate(probe);
      if (warm.ok() && !warm->prefill_worker.empty()) break;
      absl::SleepFor(absl::Milliseconds(250));
    }
    ASSERT_TRUE(warm.ok()) << warm.status() << restarted_->Stderr();
  }

  static testing::TempDir* dir_;
  static std::string model_dir_;
  static std::string ssd_dir_;
  static kv::ModelConfig* config_;
  static cli::ColocatedGenerator* reference_;
  static LocalCluster* cluster_;
  static LocalCluster* both_;  // both workers with a disk tier (started by the test using it)
  static testing::ChildProcess* restarted_;
  static std::string restarted_metrics_;
};
testing::TempDir* DiskTier::dir_ = nullptr;
std::string DiskTier::model_dir_;
std::string DiskTier::ssd_dir_;
kv::ModelConfig* DiskTier::config_ = nullptr;
cli::ColocatedGenerator* DiskTier::reference_ = nullptr;
LocalCluster* DiskTier::cluster_ = nullptr;
LocalCluster* DiskTier::both_ = nullptr;
testing::ChildProcess* DiskTier::restarted_ = nullptr;
std::string DiskTier::restarted_metrics_;

TEST_F(DiskTier, BlocksPushedOutOfDramComeBackFromDisk) {
  const GatewayRequest a = Request(RandomPrompt(100, 501));
  const std::vector<int32_t> expected = Reference(a);
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult cold, Generate(a));
  EXPECT_EQ(cold.tokens, expected);
  EXPECT_EQ(cold.prefix_hit_tokens, 0);
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult dram, Generate(a));
  EXPECT_EQ(dram.tokens, expected);
  EXPECT_EQ(dram.prefix_hit_tokens, 96);

  PushOutOfDram(600);
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult disk, Generate(a));
  EXPECT_EQ(disk.tokens, expected);
  EXPECT_EQ(disk.prefix_source, "disk") << cluster_->Log();
  EXPECT_EQ(disk.prefix_hit_tokens, 96);
  std::printf(
      "TTFT of a 100-token prompt: cold %.1f ms (%s), DRAM hit %.1f ms (%s), disk hit %.1f ms "
      "(%s)\n",
      cold.ttft_ms, cold.prefix_source.c_str(), dram.ttft_ms, dram.prefix_source.c_str(),
      disk.ttft_ms, disk.prefix_source.c_str());
  // The same prompt for another tenant: its blocks hash with another salt, so nothing on disk
  // (or in DRAM) matches it.
  GatewayRequest other = a;
  other.tenant = "disk-other";
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult foreign, Generate(other));
  EXPECT_EQ(foreign.tokens, expected);
  EXPECT_EQ(foreign.prefix_hit_tokens, 0);
  EXPECT_EQ(foreign.prefix_source, "none");
  KV_ASSERT_OK_AND_ASSIGN(
      double promoted, ScrapeMetric(PrefillMetrics(), "kvrelay:disk_tier_promoted_blocks_total"));
  EXPECT_GE(promoted, 6);
  KV_ASSERT_OK_AND_ASSIGN(double up, ScrapeMetric(PrefillMetrics(), "kvrelay:disk_tier_up"));
  EXPECT_EQ(up, 1);
  // The store knows the disk tier's blocks (announced by the workers) as tier SSD.
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo store, cluster_->Service("cachestore"));
  KV_ASSERT_OK_AND_ASSIGN(std::string text, ScrapeText(store.metrics_address));
  EXPECT_THAT(text, ::testing::HasSubstr("kvrelay:cachestore_tier_used_slots{tier=\"ssd\"}"));
  KV_ASSERT_OK_AND_ASSIGN(v1::StatsResponse stats, CacheStoreStats(store.address));
  int64_t ssd_used = 0;
  for (const auto& t : stats.tiers()) {
    if (t.tier() == v1::TIER_SSD) ssd_used = t.used_bytes();
  }
  EXPECT_GT(ssd_used, 0);
}

// A conversation's next turn whose blocks were pushed out of DRAM: the prefill worker's disk
// holds the first prompt's 5 blocks, the decode worker's disk the first turn's whole sequence
// (7 blocks: prompt and answer). The gateway has the decode worker read its disk back before
// the Reserve (WorkerSet::Promotions): the decode worker then holds all 7 in DRAM (nothing of
// them is pushed), and the prefill worker reads its own 5 from disk and pulls the 2 it lacks
// from the decode worker's DRAM (prefix_source "remote_disk"), with the reference's tokens.
TEST_F(DiskTier, ANextTurnOnAnotherNodesDiskIsPromotedThereAndPulled) {
  absl::StatusOr<std::unique_ptr<LocalCluster>> both = StartCluster(/*decode_disk=*/true);
  ASSERT_TRUE(both.ok()) << both.status();
  both_ = both->release();
  GatewayRequest first = Request(RandomPrompt(90, 701));
  first.generation.max_tokens = 30;
  const std::vector<int32_t> answer = Reference(first);
  ASSERT_EQ(answer.size(), 30u);
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult turn1, Generate(first, both_));
  EXPECT_EQ(turn1.tokens, answer);

  GatewayRequest next = Request(first.generation.tokens);
  next.generation.tokens.insert(next.generation.tokens.end(), answer.begin(), answer.end());
  for (int32_t t : RandomPrompt(10, 702)) next.generation.tokens.push_back(t);
  const std::vector<int32_t> expected = Reference(next);
  KV_ASSERT_OK_AND_ASSIGN(ServiceInfo gateway, both_->Service("gateway"));
  KV_ASSERT_OK_AND_ASSIGN(
      double promoted_before,
      ScrapeMetric(gateway.metrics_address, "kvrelay:gateway_promoted_blocks_total"));

  PushOutOfDram(800, both_);
  ASSERT_NO_FATAL_FAILURE(WaitForDiskAnnounced(both_));
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult turn2, Generate(next, both_));
  EXPECT_EQ(turn2.tokens, expected);
  EXPECT_EQ(turn2.prefix_source, "remote_disk") << both_->Log();
  EXPECT_EQ(turn2.prefix_hit_tokens, 7 * 16);
  EXPECT_EQ(turn2.decode_held_blocks, 7) << "promoted before the Reserve: not pushed";
  EXPECT_GT(turn2.fetched_bytes, 0) << "the 2 blocks the prefill worker lacked were pulled";
  KV_ASSERT_OK_AND_ASSIGN(double promoted, ScrapeMetric(gateway.metrics_address,
                                                        "kvrelay:gateway_promoted_blocks_total"));
  EXPECT_GE(promoted - promoted_before, 7);
  std::printf(
      "next turn from another node's disk: TTFT %.1f ms, %d prompt tokens reused, %lld bytes "
      "pulled\n",
      turn2.ttft_ms, turn2.prefix_hit_tokens, static_cast<long long>(turn2.fetched_bytes));
}

// Every listed slot's payload gets one flipped byte: whatever the next request reads from disk
// fails verification and is recomputed.
TEST_F(DiskTier, AFlippedByteOnDiskIsDetectedAndRecomputed) {
  const GatewayRequest c = Request(RandomPrompt(100, 701));
  const std::vector<int32_t> expected = Reference(c);
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult cold, Generate(c));
  EXPECT_EQ(cold.tokens, expected);
  PushOutOfDram(800);
  KV_ASSERT_OK_AND_ASSIGN(double corrupt_before,
                          ScrapeMetric(PrefillMetrics(), "kvrelay:disk_tier_corrupt_blocks_total"));
  const std::string file = TierFile();
  ASSERT_FALSE(file.empty());
  {
    int fd = ::open(file.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const off_t size = ::lseek(fd, 0, SEEK_END);
    for (off_t slot = 0; slot + static_cast<off_t>(SlotBytes()) <= size;
         slot += static_cast<off_t>(SlotBytes())) {
      uint32_t magic = 0;
      ASSERT_EQ(::pread(fd, &magic, sizeof(magic), slot), 4);
      if (magic == 0) continue;  // never written
      uint8_t byte = 0;
      ASSERT_EQ(::pread(fd, &byte, 1, slot + 4096 + 33), 1);
      byte ^= 0x10;
      ASSERT_EQ(::pwrite(fd, &byte, 1, slot + 4096 + 33), 1);
    }
    ::fsync(fd);
    ::close(fd);
  }
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult again, Generate(c));
  EXPECT_EQ(again.tokens, expected);
  EXPECT_NE(again.prefix_source, "disk");
  KV_ASSERT_OK_AND_ASSIGN(double corrupt_after,
                          ScrapeMetric(PrefillMetrics(), "kvrelay:disk_tier_corrupt_blocks_total"));
  EXPECT_GE(corrupt_after, corrupt_before + 1);
}

TEST_F(DiskTier, ARestartedWorkerUsesItsVerifiedDiskBlocks) {
  const GatewayRequest d = Request(RandomPrompt(100, 901));
  const std::vector<int32_t> expected = Reference(d);
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult cold, Generate(d));
  EXPECT_EQ(cold.tokens, expected);
  PushOutOfDram(1000);
  // The demotions are queued to the tier thread: give them a moment to reach the disk.
  absl::SleepFor(absl::Milliseconds(500));

  ASSERT_NO_FATAL_FAILURE(RestartPrefill(ssd_dir_ + "/prefill-0"));
  const std::string log = restarted_->Stderr() + restarted_->Stdout();
  const size_t scan = log.find("verified blocks found");
  ASSERT_NE(scan, std::string::npos) << log;
  const size_t line_start = log.rfind('\n', scan);
  std::printf(
      "restarted prefill-0: %s\n",
      log.substr(line_start == std::string::npos ? 0 : line_start + 1,
                 log.find('\n', scan) - (line_start == std::string::npos ? 0 : line_start + 1))
          .c_str());
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult after, Generate(d));
  EXPECT_EQ(after.tokens, expected);
  EXPECT_EQ(after.prefix_source, "disk") << restarted_->Stderr();
}

// A disk that fails reads (the tier's file cut to nothing behind the worker's back: every read
// comes back short, as from a failing device): the tier stops for good with a log line and a
// metric; the request that met it recomputes its prefix, and serving goes on from DRAM.
TEST_F(DiskTier, ADiskThatFailsReadsStopsTheTierAndServingGoesOn) {
  ASSERT_NE(restarted_, nullptr) << "runs after ARestartedWorkerUsesItsVerifiedDiskBlocks";
  const GatewayRequest e = Request(RandomPrompt(100, 1401));
  const std::vector<int32_t> expected = Reference(e);
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult cold, Generate(e));
  EXPECT_EQ(cold.tokens, expected);
  PushOutOfDram(1500);
  absl::SleepFor(absl::Milliseconds(500));  // the demotions reach the disk
  const std::string file = TierFile();
  ASSERT_FALSE(file.empty());
  ASSERT_EQ(::truncate(file.c_str(), 0), 0) << std::strerror(errno);
  KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult failed_read, Generate(e));
  EXPECT_EQ(failed_read.tokens, expected);
  EXPECT_NE(failed_read.prefix_source, "disk");
  EXPECT_THAT(restarted_->Stderr(),
              ::testing::HasSubstr("disk tier stopped taking blocks (io_error)"));
  KV_ASSERT_OK_AND_ASSIGN(double up, ScrapeMetric(PrefillMetrics(), "kvrelay:disk_tier_up"));
  EXPECT_EQ(up, 0);
  KV_ASSERT_OK_AND_ASSIGN(double stopped,
                          ScrapeMetric(PrefillMetrics(), "kvrelay:disk_tier_stopped_total"));
  EXPECT_EQ(stopped, 1);
  for (uint32_t i = 0; i < 3; ++i) {
    const GatewayRequest r = Request(RandomPrompt(100, 1600 + i));
    KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult out, Generate(r));
    EXPECT_EQ(out.tokens, Reference(r));
  }
}

// A disk too small for --ssd-bytes (a 64 KiB tmpfs): the restarted worker says so in one line
// and its metrics, and serves on from DRAM with the right tokens.
TEST_F(DiskTier, AFullDiskStopsTheTierAndServingGoesOn) {
  testing::TempDir small;
  if (::mount("tmpfs", small.path().c_str(), "tmpfs", 0, "size=64k") != 0) {
    GTEST_SKIP() << "SKIP: cannot mount a size-limited tmpfs here (" << std::strerror(errno) << ")";
  }
  ASSERT_NO_FATAL_FAILURE(RestartPrefill(small.path() + "/prefill-0"));
  const std::string log = restarted_->Stderr();
  EXPECT_THAT(log, ::testing::HasSubstr("disk tier stopped taking blocks (full)"));
  EXPECT_THAT(log, ::testing::HasSubstr("serving goes on from DRAM"));
  KV_ASSERT_OK_AND_ASSIGN(double up, ScrapeMetric(PrefillMetrics(), "kvrelay:disk_tier_up"));
  EXPECT_EQ(up, 0);
  KV_ASSERT_OK_AND_ASSIGN(double stopped,
                          ScrapeMetric(PrefillMetrics(), "kvrelay:disk_tier_stopped_total"));
  EXPECT_EQ(stopped, 1);
  for (uint32_t i = 0; i < 3; ++i) {
    const GatewayRequest r = Request(RandomPrompt(100, 1300 + i));
    KV_ASSERT_OK_AND_ASSIGN(cli::GenerationResult out, Generate(r));
    EXPECT_EQ(out.tokens, Reference(r));
  }
  restarted_->Signal(SIGKILL);
  (void)restarted_->Wait(absl::Seconds(10));
  ::umount2(small.path().c_str(), MNT_DETACH);
}

}  // namespace
}  // namespace kvrelay::e2e
