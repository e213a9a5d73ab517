// SIGABRT held for jaxpar's watchdog (jaxpar/runtime/abort_guard.py builds and installs it).
// XLA's jax.distributed client aborts its process when the coordination service reports a
// lost process or cannot be reached (LOG(QFATAL), then abort()): an exit status of 6 and a C++
// stack, nothing saying who went missing. This handler holds the aborting thread: it tells
// the watchdog thread through a pipe, which names the lost process and ends the whole job with
// its own status; if nothing has ended the process within the wait, the handler writes the
// sentence prepared in advance and exits with that status itself. Only async-signal-safe
// calls here (write, nanosleep, _exit).
#include <csignal>
#include <cstring>
#include <ctime>
#include <unistd.h>

static int notify_fd = -1, report_fd = -1, exit_code = 75, wait_ms = 10000;
static struct sigaction before;  // SIGABRT's action before the guard, put back by Unguard
static char fallback[4096];
static volatile size_t fallback_len = 0;

static void OnAbort(int) {
  if (notify_fd >= 0) {
    char c = 'A';
    ssize_t ignored = write(notify_fd, &c, 1);
    (void)ignored;
  }
  for (int waited = 0; waited < wait_ms; waited += 50) {
    struct timespec tick = {0, 50 * 1000 * 1000};
    nanosleep(&tick, nullptr);
  }
  if (report_fd >= 0 && fallback_len > 0) {
    ssize_t ignored = write(report_fd, fallback, fallback_len);
    (void)ignored;
  }
  _exit(exit_code);
}

// The sentence written if the watchdog does not end the process first ("" for none).
extern "C" void JaxparAbortMessage(const char* text) {
  fallback_len = 0;
  size_t n = strnlen(text, sizeof(fallback) - 1);
  memcpy(fallback, text, n);
  fallback_len = n;
}

// Hold SIGABRT from now on: tell `notify` (a pipe's write end), wait `wait` ms, write the
// sentence to `report`, exit with `code`. 0, or -1 (errno) when sigaction fails.
extern "C" int JaxparGuardAborts(int notify, int report, int code, int wait) {
  notify_fd = notify;
  report_fd = report;
  exit_code = code;
  wait_ms = wait;
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_handler = OnAbort;
  sigemptyset(&action.sa_mask);
  return sigaction(SIGABRT, &action, &before);
}

// SIGABRT as it was before JaxparGuardAborts (the run is over); closes the notice's pipe end.
extern "C" void JaxparUnguardAborts() {
  sigaction(SIGABRT, &before, nullptr);
  if (notify_fd >= 0) close(notify_fd);
  notify_fd = -1;
}
