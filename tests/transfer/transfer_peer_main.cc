// kvrelay_transfer_peer: the receiving process of the multi-process transfer tests, and a
// stand-alone copy of `kvrelay transfer-bench` (same code, fewer dependencies):
//   kvrelay_transfer_peer transfer-bench [--role=receiver] [flags]

#include <cstdio>
#include <cstring>

#include "common/flags.h"
#include "transfer/ucx/tools/command.h"

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "transfer-bench") != 0) {
    std::fprintf(stderr, "usage: %s transfer-bench [--role=receiver] [flags]\n", argv[0]);
    return 2;
  }
  return kvrelay::transfer::ucx::tools::RunTransferBenchCommand(kvrelay::ArgsFrom(argc, argv, 2));
}
