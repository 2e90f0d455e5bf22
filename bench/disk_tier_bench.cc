// Disk tier bandwidth (issue 30): kv::DiskTier writing and reading blocks as a worker does
// (header, XXH3 checksums, copy in and out of the caller's memory, verify on read) against
// `fio` writing and reading a file of the same size in the same directory with O_DIRECT,
// io_uring, the same block size and queue depth, random order, measured in the same run and
// alternating round by round so machine load hits both alike. Prints each round and the
// median ratio per block size and direction (the bar: >= 0.8x).
//
//   build/bin/disk_tier_bench --dir /mnt/nvme/bench --block-bytes 65536,1048576
//       --queue-depth 32 --bytes 1073741824 --rounds 3   (one command line)
//
// Needs fio (Debian package fio). Payload bandwidth: ours counts block bytes, not the 4 KiB
// header each slot carries.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kv/disk/disk_tier.h"
#include "nlohmann/json.hpp"

namespace {

struct Flags {
  std::string dir = "/tmp/kvrelay-disk-bench";
  std::vector<uint64_t> block_bytes = {65536, 1048576};
  uint32_t queue_depth = 32;
  uint64_t bytes = 1ull << 30;
  int rounds = 3;
};

[[noreturn]] void Usage(const std::string& why) {
  std::cerr << "disk_tier_bench: " << why
            << "\nflags: --dir D --block-bytes B[,B...] --queue-depth Q --bytes N --rounds R\n";
  std::exit(2);
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) Usage(flag + " needs a value");
    const std::string value = argv[++i];
    uint64_t n = 0;
    if (flag == "--dir") {
      f.dir = value;
    } else if (flag == "--block-bytes") {
      f.block_bytes.clear();
      for (absl::string_view part : absl::StrSplit(value, ',')) {
        if (!absl::SimpleAtoi(part, &n) || n == 0 || n % 4096 != 0) {
          Usage(absl::StrCat("--block-bytes wants multiples of 4096, got ", part));
        }
        f.block_bytes.push_back(n);
      }
    } else if (flag == "--queue-depth" && absl::SimpleAtoi(value, &n) && n > 0 && n <= 4096) {
      f.queue_depth = static_cast<uint32_t>(n);
    } else if (flag == "--bytes" && absl::SimpleAtoi(value, &n) && n > 0) {
      f.bytes = n;
    } else if (flag == "--rounds" && absl::SimpleAtoi(value, &n) && n > 0) {
      f.rounds = static_cast<int>(n);
    } else {
      Usage("bad flag " + flag + " " + value);
    }
  }
  return f;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// fio's bandwidth in MiB/s for one job, or exits naming what failed.
double RunFio(const Flags& f, uint64_t block, bool write) {
  const std::string file = f.dir + "/fio.data";
  const uint64_t size = f.bytes / block * block;
  const std::string cmd =
      absl::StrCat("fio --name=kvrelay --filename=", file, " --size=", size, " --bs=", block,
                   " --iodepth=", f.queue_depth,
                   " --ioengine=io_uring --direct=1 --rw=", write ? "randwrite" : "randread",
                   " --numjobs=1 --output-format=json 2>&1");
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) Usage("cannot run fio");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  if (pclose(pipe) != 0) {
    std::cerr << "disk_tier_bench: fio failed (is the fio package installed?):\n" << out;
    std::exit(1);
  }
  const nlohmann::json j = nlohmann::json::parse(out.substr(out.find('{')));
  const auto& job = j["jobs"][0][write ? "write" : "read"];
  return job["bw_bytes"].get<double>() / (1 << 20);
}

struct Ours {
  std::unique_ptr<kvrelay::kv::DiskTier> tier;
  std::vector<std::vector<uint8_t>> sources;  // distinct block contents, cycled
  std::vector<int64_t> order;                 // a random permutation of the slots
};

Ours OpenOurs(const Flags& f, uint64_t block) {
  kvrelay::kv::DiskTierOptions o;
  o.directory = f.dir;
  o.block_bytes = block;
  o.capacity_bytes = f.bytes / block * (block + kvrelay::kv::DiskTier::kHeaderBytes);
  o.queue_depth = f.queue_depth;
  o.layout.bytes[0] = static_cast<uint8_t>(block >> 12);  // a file per block size
  auto tier = kvrelay::kv::DiskTier::Open(o);
  if (!tier.ok()) {
    std::cerr << "disk_tier_bench: " << tier.status() << "\n";
    std::exit(1);
  }
  Ours ours{std::move(*tier), {}, {}};
  std::mt19937_64 rng(block);
  for (int i = 0; i < 16; ++i) {
    std::vector<uint8_t> bytes(block);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    ours.sources.push_back(std::move(bytes));
  }
  ours.order.resize(ours.tier->num_slots());
  std::iota(ours.order.begin(), ours.order.end(), 0);
  std::shuffle(ours.order.begin(), ours.order.end(), rng);
  return ours;
}

// Writes (or reads and verifies) every slot in batches of 4x the queue depth, as a worker's
// tier thread hands them over; MiB/s of block bytes.
double RunOurs(Ours& ours, uint32_t queue_depth, bool write) {
  const uint64_t block = ours.tier->block_bytes();
  const size_t batch = 4 * queue_depth;
  std::vector<std::vector<uint8_t>> outs(batch, std::vector<uint8_t>(block));
  const auto start = std::chrono::steady_clock::now();
  for (size_t first = 0; first < ours.order.size(); first += batch) {
    const size_t n = std::min(batch, ours.order.size() - first);
    std::vector<absl::Status> statuses;
    if (write) {
      std::vector<kvrelay::kv::DiskTier::BlockWrite> writes;
      for (size_t i = 0; i < n; ++i) {
        const int64_t slot = ours.order[first + i];
        writes.push_back({slot, {static_cast<uint64_t>(slot), 1}, ours.sources[slot % 16]});
      }
      statuses = ours.tier->WriteBlocks(writes);
    } else {
      std::vector<kvrelay::kv::DiskTier::BlockRead> reads;
      for (size_t i = 0; i < n; ++i) {
        const int64_t slot = ours.order[first + i];
        reads.push_back({slot, {static_cast<uint64_t>(slot), 1}, absl::MakeSpan(outs[i])});
      }
      statuses = ours.tier->ReadBlocks(reads);
    }
    for (const absl::Status& s : statuses) {
      if (!s.ok()) {
        std::cerr << "disk_tier_bench: " << s << "\n";
        std::exit(1);
      }
    }
  }
  const double seconds = Seconds(start);
  return static_cast<double>(ours.order.size() * block) / (1 << 20) / seconds;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = ParseFlags(argc, argv);
  std::filesystem::create_directories(f.dir);
  std::cout << "disk tier vs fio in " << f.dir << ": " << f.bytes << " bytes per run, QD "
            << f.queue_depth << ", " << f.rounds << " rounds, O_DIRECT io_uring, random order\n";
  for (uint64_t block : f.block_bytes) {
    Ours ours = OpenOurs(f, block);
    if (!ours.tier->direct_io()) std::cout << "  (the file system refuses O_DIRECT: page cache)\n";
    for (bool write : {true, false}) {
      std::vector<double> ratios;
      std::vector<double> ours_rates;
      std::vector<double> fio_rates;
      for (int r = 0; r < f.rounds; ++r) {
        const double fio = RunFio(f, block, write);
        const double mine = RunOurs(ours, f.queue_depth, write);
        fio_rates.push_back(fio);
        ours_rates.push_back(mine);
        ratios.push_back(mine / fio);
        std::printf("  round %d %s %7llu KiB: ours %8.1f MiB/s  fio %8.1f MiB/s  ratio %.2f\n",
                    r + 1, write ? "write" : "read ", static_cast<unsigned long long>(block >> 10),
                    mine, fio, mine / fio);
      }
      const double ratio = Median(ratios);
      std::printf("%s %llu KiB QD%u: ours %.1f MiB/s, fio %.1f MiB/s (medians), ratio %.2f%s\n",
                  write ? "write" : "read", static_cast<unsigned long long>(block >> 10),
                  f.queue_depth, Median(ours_rates), Median(fio_rates), ratio,
                  ratio < 0.8 ? "  BELOW 0.8" : "");
    }
    const std::string path = ours.tier->path();
    ours.tier.reset();
    std::filesystem::remove(path);
  }
  std::filesystem::remove(f.dir + "/fio.data");
  return 0;
}
