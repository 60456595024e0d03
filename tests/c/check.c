/* check.c - see check.h. */
#include "check.h"

#include <stdarg.h>
#include <string.h>

long g_fail, g_pass;

void check_failed(int fatal, const char *file, int line, const char *cond, const char *fmt,
                  ...) {
  long n = __atomic_add_fetch(&g_fail, 1, __ATOMIC_RELAXED);
  if (n <= 200 || fatal) {
    const char *base = strrchr(file, '/');
    va_list ap;
    va_start(ap, fmt);
    flockfile(stderr); /* one line per failure, even from several threads */
    fprintf(stderr, "FAIL %s:%d: %s: ", base ? base + 1 : file, line, cond);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    funlockfile(stderr);
    va_end(ap);
  }
  if (fatal) exit(1);
}

int report(const char *suite) {
  printf("%s: %ld passed, %ld failed%s\n", suite, g_pass, g_fail,
         g_fail > 200 ? " (the first 200 failures printed)" : "");
  return g_fail ? 1 : 0;
}
