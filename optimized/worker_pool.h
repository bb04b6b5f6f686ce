// A few persistent threads that share out the tasks of one call, so a decode step can use
// two cores without starting a thread per step.
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace kvcheck::optimized {

// A task to run: a callable borrowed for the length of one run(), never copied, so starting
// a run allocates nothing.
class TaskRef {
 public:
  template <class F>
  TaskRef(const F& f) : object_(&f), call_([](const void* o, int i, int p) { (*static_cast<const F*>(o))(i, p); }) {}
  void operator()(int task, int participant) const { call_(object_, task, participant); }

 private:
  const void* object_;
  void (*call_)(const void*, int, int);
};

class WorkerPool {
 public:
  // `threads` participants: the calling thread plus threads - 1 workers.
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls task(i, participant) for every i in [0, count) and returns when all are done.
  // `participant` (0 .. size() - 1) names scratch space no other running task uses.
  // The first exception a task throws is rethrown here once every task has stopped.
  void run(int count, TaskRef task);

 private:
  void work(int participant);
  void take_tasks(int participant);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const TaskRef* task_ = nullptr;
  int count_ = 0, next_ = 0, busy_ = 0;
  unsigned generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr failure_;
};

}  // namespace kvcheck::optimized
