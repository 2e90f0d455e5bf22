#pragma once

// A gRPC server that takes every call and never answers it, for tests of bounded waits on a
// dependency that hangs (a SIGSTOPped process behaves the same to its callers). Header-only:
// its users link gRPC::grpc++ themselves.

#include <chrono>
#include <memory>
#include <string>

#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"

namespace kvrelay::testing {

// A gRPC server that takes every call and never answers it: calls end only at their deadline.
class SilentServer {
 public:
  SilentServer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterAsyncGenericService(&service_);
    cq_ = builder.AddCompletionQueue();
    server_ = builder.BuildAndStart();
  }
  ~SilentServer() {
    server_->Shutdown(std::chrono::system_clock::now());
    cq_->Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_->Next(&tag, &ok)) {
    }
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int port_ = 0;
  grpc::AsyncGenericService service_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace kvrelay::testing
