/* loopback.h - for the tests that play a transport's peer by hand (test_link_auth.c,
 * fuzz_link.c): a client socket to a transport's listener on 127.0.0.1. Header-only, so
 * fuzz_link.c still builds for libFuzzer from the core's sources alone. */
#ifndef RPL_TEST_LOOPBACK_H
#define RPL_TEST_LOOPBACK_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* Connects to the listener of a transport address "ADDR:PORT:ID:UCXPORT"; -1 if refused. */
static inline int dial(const char *addr) {
  unsigned port = 0;
  sscanf(strchr(addr, ':') + 1, "%u", &port);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    close(fd);
    fd = -1;
  }
  return fd;
}

/* The transport's id in such an address (what HS1 names). */
static inline uint64_t id_of(const char *addr) {
  const char *c = strchr(strchr(addr, ':') + 1, ':');
  return strtoull(c + 1, NULL, 16);
}

/* Reads n bytes within wait_s: n, 0 if the peer closed, -1 on time-out. */
static inline int read_n(int fd, unsigned char *buf, size_t n, double wait_s) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  size_t got = 0;
  while (got < n) {
    clock_gettime(CLOCK_MONOTONIC, &t);
    double spent = (double)(t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) * 1e-9;
    int ms = (int)((wait_s - spent) * 1000);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (ms <= 0 || poll(&p, 1, ms) <= 0) return -1;
    ssize_t r = recv(fd, buf + got, n - got, 0);
    if (r <= 0) return 0;
    got += (size_t)r;
  }
  return (int)n;
}

#endif /* RPL_TEST_LOOPBACK_H */
