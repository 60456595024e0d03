/*
 * check.h - the assertions of every C test (core, Group Generator, coordinator), defined in
 * check.c, which each test links. Safe to use from several threads.
 *
 *   CHECK(cond, fmt, ...)    counts a pass, or prints "FAIL file:line: cond: message", counts a
 *                            failure and goes on, so one run shows every broken property;
 *                            main ends with `return report("suite");`.
 *   REQUIRE(cond, fmt, ...)  the same check, but a failure ends the program (exit 1): for the
 *                            checks that the code after them depends on.
 *   OK(call)                 REQUIRE that call returns RPL_OK; calls pass &e_ as their
 *                            rpl_error, whose message the failure prints.
 *
 * The message's arguments are evaluated only when the check fails.
 */
#ifndef RPL_TEST_CHECK_H
#define RPL_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

extern long g_fail, g_pass;

/* Records a failed check (printing only the first 200, enough to diagnose without drowning
 * the log); exits 1 if `fatal`. */
__attribute__((format(printf, 5, 6))) void check_failed(int fatal, const char *file, int line,
                                                        const char *cond, const char *fmt, ...);

#define CHECK_AT_(fatal, cond, ...)                                         \
  do {                                                                      \
    if (cond)                                                               \
      __atomic_fetch_add(&g_pass, 1, __ATOMIC_RELAXED);                     \
    else                                                                    \
      check_failed((fatal), __FILE__, __LINE__, #cond, __VA_ARGS__);        \
  } while (0)
#define CHECK(cond, ...) CHECK_AT_(0, cond, __VA_ARGS__)
#define REQUIRE(cond, ...) CHECK_AT_(1, cond, __VA_ARGS__)

#define OK(call)                                                   \
  do {                                                             \
    rpl_error e_;                                                  \
    rpl_status s_ = (call);                                        \
    REQUIRE(s_ == RPL_OK, "%s -> %d: %s", #call, (int)s_, e_.msg); \
  } while (0)

/* Prints "suite: N passed, M failed" and returns main's exit code (1 if anything failed). */
int report(const char *suite);

#endif /* RPL_TEST_CHECK_H */
