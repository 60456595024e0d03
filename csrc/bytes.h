/*
 * bytes.h - little-endian integers in byte buffers (internal to csrc/): what every wire format
 * of the core (frames, the link handshake, partial rounds) and of the Group Generator's
 * protocol (csrc/sched/proto.c) writes and reads.
 */
#ifndef RPL_BYTES_H
#define RPL_BYTES_H

#include <stdint.h>

static inline void rpl_put16(unsigned char *p, uint16_t v) {
  p[0] = (unsigned char)v;
  p[1] = (unsigned char)(v >> 8);
}
static inline void rpl_put32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static inline void rpl_put64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static inline uint16_t rpl_get16(const unsigned char *p) {
  return (uint16_t)(p[0] | p[1] << 8);
}
static inline uint32_t rpl_get32(const unsigned char *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static inline uint64_t rpl_get64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

#endif /* RPL_BYTES_H */
