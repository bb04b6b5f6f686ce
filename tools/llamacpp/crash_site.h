// Who a crash of the llama.cpp engine process belongs to. A signal raised inside a llama.cpp
// call is llama.cpp's (a finding); one raised in the driver's own code is kvcheck's fault.
// The engine installs a handler that, before the process dies of the signal, writes to a
// file which loaded object the faulting code lies in: the instruction that faulted, or, when
// that is in the C library (an abort, a memcpy), the first caller outside it. The parent
// (`kvcheck llamacpp`) reads the file to blame the right party.
#pragma once

#include <string>

namespace kvcheck::llamacpp {

// Installs the handler for SIGSEGV, SIGBUS, SIGFPE, SIGILL and SIGABRT; `file` receives
// "llama.cpp <library>" or "kvcheck <object>" (one line), then the signal takes its course.
void record_crash_site(const std::string& file);

// What record_crash_site wrote in `file`, or "" when nothing was (no crash, or one the
// handler could not see, such as a kill).
std::string read_crash_site(const std::string& file);

// Whether a site read back is llama.cpp's (its libllama or libggml libraries).
bool crash_site_is_llamacpp(const std::string& site);

}  // namespace kvcheck::llamacpp
