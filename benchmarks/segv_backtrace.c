// LD_PRELOAD helper for machines without gdb: prints the native stack when the process gets SIGSEGV.
// gcc -shared -fPIC -o /tmp/segv.so benchmarks/segv_backtrace.c
// LD_PRELOAD=/tmp/segv.so python3 -m pytest -p no:faulthandler ...   (faulthandler would replace the handler)
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

static void on_segv(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) { signal(SIGSEGV, on_segv); }
