#include "tools/llamacpp/crash_site.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

namespace kvcheck::llamacpp {
namespace {

char site_file[4096];

enum class Owner { llamacpp, system, driver, unknown };

// Which loaded object `address` lies in, and its path.
Owner owner_of(void* address, const char** name) {
  Dl_info info{};
  if (address == nullptr || dladdr(address, &info) == 0 || info.dli_fname == nullptr) {
    *name = "?";
    return Owner::unknown;
  }
  *name = info.dli_fname;
  const char* base = std::strrchr(info.dli_fname, '/');
  base = base ? base + 1 : info.dli_fname;
  if (std::strncmp(base, "libllama", 8) == 0 || std::strncmp(base, "libggml", 7) == 0) return Owner::llamacpp;
  if (std::strncmp(base, "libc.", 5) == 0 || std::strncmp(base, "libc-", 5) == 0 ||
      std::strncmp(base, "libstdc++", 9) == 0 || std::strncmp(base, "libgcc", 6) == 0 ||
      std::strncmp(base, "libm.", 5) == 0 || std::strncmp(base, "ld-linux", 8) == 0 ||
      std::strncmp(base, "libpthread", 10) == 0 || std::strncmp(base, "libasan", 7) == 0 ||
      std::strncmp(base, "libubsan", 8) == 0 || std::strncmp(base, "libgomp", 7) == 0)
    return Owner::system;
  return Owner::driver;
}

void write_site(Owner owner, const char* name) {
  const int fd = ::open(site_file, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  const char* who = owner == Owner::llamacpp ? "llama.cpp " : "kvcheck ";
  [[maybe_unused]] ssize_t n = ::write(fd, who, std::strlen(who));
  n = ::write(fd, name, std::strlen(name));
  n = ::write(fd, "\n", 1);
  ::close(fd);
}

void on_crash(int sig, siginfo_t*, void* context) {
  void* pc = nullptr;
#if defined(__x86_64__)
  pc = reinterpret_cast<void*>(static_cast<ucontext_t*>(context)->uc_mcontext.gregs[REG_RIP]);
#elif defined(__aarch64__)
  pc = reinterpret_cast<void*>(static_cast<ucontext_t*>(context)->uc_mcontext.pc);
#else
  (void)context;
#endif
  const char* name = "?";
  Owner owner = owner_of(pc, &name);
  if (owner == Owner::system || owner == Owner::unknown) {
    // An abort or a library routine: the first caller outside the system libraries, among
    // the frames after the faulting one (or, unseen, after the signal's own frames).
    void* frames[64];
    const int n = backtrace(frames, 64);
    int from = 0;
    for (int i = 0; i < n; ++i)
      if (frames[i] == pc) from = i + 1;
    if (from == 0) {  // skip this handler's frames (in the driver) and the trampoline
      while (from < n && owner_of(frames[from], &name) == Owner::driver) ++from;
      while (from < n && owner_of(frames[from], &name) == Owner::system) ++from;
    }
    for (int i = from; i < n; ++i) {
      const Owner o = owner_of(frames[i], &name);
      if (o == Owner::llamacpp || o == Owner::driver) {
        owner = o;
        break;
      }
    }
  }
  write_site(owner == Owner::llamacpp ? Owner::llamacpp : Owner::driver, name);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace

void record_crash_site(const std::string& file) {
  std::strncpy(site_file, file.c_str(), sizeof site_file - 1);
  void* warm[1];
  backtrace(warm, 1);  // loads the unwinder now, not inside the handler
  struct sigaction action {};
  action.sa_sigaction = on_crash;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::sigaction(sig, &action, nullptr);
}

std::string read_crash_site(const std::string& file) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  return line;
}

bool crash_site_is_llamacpp(const std::string& site) { return site.rfind("llama.cpp ", 0) == 0; }

}  // namespace kvcheck::llamacpp
