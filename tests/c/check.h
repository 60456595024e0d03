/* check.h - the assertion macros of the standalone C tests (sched, coordinator), which link
 * neither the core nor tests/c/harness.c. A failed check prints where and why, and exits 1. */
#ifndef RPL_TEST_CHECK_H
#define RPL_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                            \
      fprintf(stderr, "\n");                                                   \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

/* OK(call): the call must return RPL_OK; calls pass &e_ as their rpl_error. */
#define OK(call)                                                 \
  do {                                                           \
    rpl_error e_;                                                \
    rpl_status s_ = (call);                                      \
    CHECK(s_ == RPL_OK, "%s -> %d: %s", #call, (int)s_, e_.msg); \
  } while (0)

#endif /* RPL_TEST_CHECK_H */
