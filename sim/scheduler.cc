#include "sim/scheduler.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "common/check.h"

#if defined(__SANITIZE_ADDRESS__)
#define KVRELAY_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVRELAY_SIM_ASAN 1
#endif
#endif
#ifdef KVRELAY_SIM_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

namespace kvrelay::sim {
namespace {

// Serving code's deepest call chains (a request through GenerateCall into the store, under
// ASan's larger frames) stay far below this; pages are committed only when touched.
constexpr size_t kStackBytes = size_t{1} << 20;

size_t PageSize() {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// One process's stack: mapped once, with a guard page below it, and reused by later processes.
class FiberStack {
 public:
  FiberStack() {
    const size_t guard = PageSize();
    void* p = ::mmap(nullptr, kStackBytes + guard, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    KV_CHECK(p != MAP_FAILED);  // mmap of a simulated process's stack
    KV_CHECK(::mprotect(p, guard, PROT_NONE) == 0);
    base_ = static_cast<char*>(p);
  }
  ~FiberStack() { ::munmap(base_, kStackBytes + PageSize()); }
  FiberStack(const FiberStack&) = delete;
  FiberStack& operator=(const FiberStack&) = delete;
  void* bottom() const { return base_ + PageSize(); }
  size_t size() const { return kStackBytes; }

 private:
  char* base_ = nullptr;
};

}  // namespace

struct Scheduler::Context {
  ucontext_t run;  // Run()'s, while a process runs
  std::vector<std::unique_ptr<FiberStack>> spare_stacks;
  // ASan's view of the stack switched from (Run()'s thread stack), learned at the first switch.
  const void* run_stack_bottom = nullptr;
  size_t run_stack_size = 0;
  void* run_fake_stack = nullptr;
};

struct Scheduler::Process {
  Scheduler* owner = nullptr;
  ucontext_t context;
  std::unique_ptr<FiberStack> stack;
  std::function<void()> body;
  bool done = false;  // the body returned: the stack may be reused once switched away from
  void* fake_stack = nullptr;
};

Scheduler::Scheduler(SimulatedClock* clock)
    : clock_(clock), context_(std::make_unique<Context>()) {}

Scheduler::~Scheduler() { KV_CHECK(live_ == 0); }  // a process still parked

void Scheduler::Push(absl::Time at, std::function<void()> callback, Process* process) {
  queue_.push(Event{std::max(at, clock_->Now()), next_seq_++, std::move(callback), process});
}

void Scheduler::At(absl::Time at, std::function<void()> callback) {
  Push(at, std::move(callback), nullptr);
}

void Scheduler::Spawn(absl::Time at, std::function<void()> body) {
  if (at > clock_->Now()) {
    At(at, [this, body = std::move(body)]() mutable { Spawn(clock_->Now(), std::move(body)); });
    return;
  }
  auto* process = new Process();
  process->owner = this;
  process->body = std::move(body);
  if (context_->spare_stacks.empty()) {
    process->stack = std::make_unique<FiberStack>();
  } else {
    process->stack = std::move(context_->spare_stacks.back());
    context_->spare_stacks.pop_back();
  }
  KV_CHECK(::getcontext(&process->context) == 0);
  process->context.uc_stack.ss_sp = process->stack->bottom();
  process->context.uc_stack.ss_size = process->stack->size();
  process->context.uc_link = nullptr;  // the body switches back itself
  // makecontext passes int arguments: the pointer goes in two halves.
  const auto bits = reinterpret_cast<uintptr_t>(process);
  ::makecontext(&process->context, reinterpret_cast<void (*)()>(&Scheduler::ProcessEntry), 2,
                static_cast<unsigned int>(static_cast<uint64_t>(bits) >> 32),
                static_cast<unsigned int>(bits & 0xffffffffu));
  ++started_;
  peak_live_ = std::max(peak_live_, ++live_);
  Push(at, nullptr, process);
}

void Scheduler::ProcessEntry(unsigned int high, unsigned int low) {
  auto* process =
      reinterpret_cast<Process*>(static_cast<uintptr_t>((static_cast<uint64_t>(high) << 32) | low));
  Scheduler* self = process->owner;
#ifdef KVRELAY_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &self->context_->run_stack_bottom,
                                  &self->context_->run_stack_size);
#endif
  process->body();
  process->body = nullptr;  // what it captured goes while the process still runs
  process->done = true;
  self->SwitchToScheduler(process, /*finished=*/true);
  KV_CHECK(false && "a finished simulated process was resumed");
}

Scheduler::Process* Scheduler::Current() const {
  KV_CHECK(running_ != nullptr);  // called from a simulated process
  return running_;
}

void Scheduler::SwitchToScheduler(Process* self, bool finished) {
#ifdef KVRELAY_SIM_ASAN
  __sanitizer_start_switch_fiber(finished ? nullptr : &self->fake_stack, context_->run_stack_bottom,
                                 context_->run_stack_size);
#else
  (void)finished;
#endif
  KV_CHECK(::swapcontext(&self->context, &context_->run) == 0);
#ifdef KVRELAY_SIM_ASAN
  __sanitizer_finish_switch_fiber(self->fake_stack, &context_->run_stack_bottom,
                                  &context_->run_stack_size);
#endif
}

void Scheduler::Park() { SwitchToScheduler(Current(), /*finished=*/false); }

void Scheduler::Wake(Process* process) { Push(clock_->Now(), nullptr, process); }

void Scheduler::SleepUntil(absl::Time t) {
  if (t <= clock_->Now()) return;
  Push(t, nullptr, Current());
  Park();
}

void Scheduler::Resume(Process* process) {
  running_ = process;
#ifdef KVRELAY_SIM_ASAN
  __sanitizer_start_switch_fiber(&context_->run_fake_stack, process->stack->bottom(),
                                 process->stack->size());
#endif
  KV_CHECK(::swapcontext(&context_->run, &process->context) == 0);
#ifdef KVRELAY_SIM_ASAN
  __sanitizer_finish_switch_fiber(context_->run_fake_stack, nullptr, nullptr);
#endif
  running_ = nullptr;
  if (process->done) {
    context_->spare_stacks.push_back(std::move(process->stack));
    delete process;
    --live_;
  }
}

void Scheduler::Run() {
  while (!queue_.empty()) {
    // top() is const only so that the heap's order cannot change: moving out before pop()
    // leaves `at` and `seq` intact.
    Event event = std::move(const_cast<Event&>(queue_.top()));
    queue_.pop();
    ++events_;
    if (event.at > clock_->Now()) clock_->Set(event.at);
    if (event.process != nullptr) {
      Resume(event.process);
    } else {
      event.callback();
    }
  }
}

void SimMutex::Lock() {
  if (!held_) {
    held_ = true;
    return;
  }
  waiters_.push_back(scheduler_->Current());
  scheduler_->Park();  // handed over by Unlock: held_ stays true, now ours
}

void SimMutex::Unlock() {
  KV_CHECK(held_);
  if (waiters_.empty()) {
    held_ = false;
    return;
  }
  Scheduler::Process* next = waiters_.front();
  waiters_.pop_front();
  scheduler_->Wake(next);
}

}  // namespace kvrelay::sim
