#include "optimized/worker_pool.h"

#include <utility>

namespace kvcheck::optimized {

WorkerPool::WorkerPool(int threads) {
  for (int p = 1; p < threads; ++p) workers_.emplace_back([this, p] { work(p); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void WorkerPool::take_tasks(int participant) {
  std::unique_lock lock(mutex_);
  while (next_ < count_) {
    const int i = next_++;
    lock.unlock();
    try {
      (*task_)(i, participant);
    } catch (...) {
      lock.lock();
      if (!failure_) failure_ = std::current_exception();
      next_ = count_;  // the remaining tasks are not started
      continue;
    }
    lock.lock();
  }
}

void WorkerPool::run(int count, TaskRef task) {
  if (workers_.empty() || count <= 1) {
    for (int i = 0; i < count; ++i) task(i, 0);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    task_ = &task;
    count_ = count;
    next_ = 0;
    busy_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  take_tasks(0);
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return busy_ == 0; });
  task_ = nullptr;
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

void WorkerPool::work(int participant) {
  unsigned seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    take_tasks(participant);
    std::lock_guard lock(mutex_);
    if (--busy_ == 0) done_.notify_one();
  }
}

}  // namespace kvcheck::optimized
