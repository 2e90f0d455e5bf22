#include "sim/scheduler.h"

#include <algorithm>
#include <utility>

#include "common/check.h"

namespace kvrelay::sim {

struct Scheduler::Process {
  std::thread thread;
  std::binary_semaphore turn{0};  // released: this process holds the baton
  bool done = false;              // set by the process before it hands the baton back
};

namespace {
thread_local Scheduler::Process* current_process = nullptr;
}  // namespace

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
  ++started_;
  peak_live_ = std::max(peak_live_, ++live_);
  process->thread = std::thread(&Scheduler::ProcessMain, this, process, std::move(body));
  Push(at, nullptr, process);
}

void Scheduler::ProcessMain(Scheduler* self, Process* process, std::function<void()> body) {
  current_process = process;
  process->turn.acquire();
  body();
  process->done = true;
  self->baton_back_.release();
}

Scheduler::Process* Scheduler::Current() const {
  KV_CHECK(current_process != nullptr);  // called from a simulated process
  return current_process;
}

void Scheduler::Park() {
  Process* self = Current();
  baton_back_.release();
  self->turn.acquire();
}

void Scheduler::Wake(Process* process) { Push(clock_->Now(), nullptr, process); }

void Scheduler::SleepUntil(absl::Time t) {
  if (t <= clock_->Now()) return;
  Push(t, nullptr, Current());
  Park();
}

void Scheduler::Resume(Process* process) {
  // The semaphores order memory too: what the process wrote is visible here after acquire.
  process->turn.release();
  baton_back_.acquire();
  if (process->done) {
    process->thread.join();
    delete process;
    --live_;
  }
}

void Scheduler::Run() {
  while (!queue_.empty()) {
    Event event = queue_.top();
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
