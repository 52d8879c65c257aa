/* A native backtrace where a process segfaults, for hosts without gdb (the H200 host has none):
 *   gcc -shared -fPIC -O0 -o /tmp/segv.so docs/bench/scripts/segv_backtrace.c
 *   LD_PRELOAD=/tmp/segv.so python3 ...
 * Frames of shared objects show as lib+offset: `addr2line -f -C -e LIB OFFSET` names them (build
 * the library with -g). Written for DeepGEMM's JIT crash (docs/bench/session12/README.md). */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_fault(int sig) {
    void *frames[64];
    int n = backtrace(frames, 64);
    const char *head = "\n== native backtrace (segv_backtrace.so) ==\n";
    write(2, head, strlen(head));
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_fault;
    sa.sa_flags = SA_RESETHAND | SA_NODEFER;
    sigaction(SIGSEGV, &sa, 0);
    sigaction(SIGABRT, &sa, 0);
}
