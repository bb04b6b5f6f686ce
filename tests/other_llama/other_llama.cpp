// A stand-in for llama.cpp builds kvcheck's declarations do not know: libllama, libggml and
// libggml-base (this one file, built three times) answer llama_version() with another
// version, or (KVCHECK_NO_VERSION: builds before spring 2026) have no llama_version(), so the
// declared engine's refusals can be tested without a second llama.cpp.
#ifndef KVCHECK_NO_VERSION
extern "C" __attribute__((visibility("default"))) const char* llama_version();
extern "C" const char* llama_version() { return "0.9.9-other"; }
#else
extern "C" __attribute__((visibility("default"))) int llama_backend_placeholder();
extern "C" int llama_backend_placeholder() { return 0; }
#endif
