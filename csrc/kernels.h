/*
 * kernels.h - reduction kernels of the core (internal to csrc/).
 *
 * Plain loops over contiguous buffers that the compiler vectorises. float16 and bfloat16 are
 * converted to float32, combined in float32 and rounded back (round-to-nearest-even).
 * Bool buffers hold 0/1 bytes: SUM/MAX/BOR are OR, PRODUCT/MIN/BAND are AND, BXOR is XOR.
 * AVG combines like SUM; the caller divides with rpl_divide() once all contributions are in.
 * Unsupported (dtype, op) pairs leave the output untouched: callers check with
 * rpl_reduce_check() first.
 */
#ifndef RPL_KERNELS_H
#define RPL_KERNELS_H

#include "ripples.h"

/* dst[i] = dst[i] op src[i], i < n. dst and src must not overlap (unless equal). */
void rpl_reduce_into(void *dst, const void *src, size_t n, rpl_dtype dtype, rpl_redop op);

/* dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], combined left to right, with
 * float16/bfloat16 accumulated in float32 and rounded once at the end. dst may equal one of
 * the srcs. nsrc >= 1. */
void rpl_reduce_many(void *dst, const void *const *srcs, int nsrc, size_t n, rpl_dtype dtype,
                     rpl_redop op);

/* buf[i] *= factor for floating dtypes (float16/bfloat16 through float32). No-op for others. */
void rpl_scale(void *buf, size_t n, rpl_dtype dtype, double factor);

/* buf[i] /= divisor for floating dtypes (a true division, as torch's `t /= n`, so AVG matches
 * gloo bit for bit where the sums agree). No-op for others. */
void rpl_divide(void *buf, size_t n, rpl_dtype dtype, double divisor);

/* Conversions, exposed for tests and for the shim's staging code. */
float rpl_half_to_float(uint16_t h);
uint16_t rpl_float_to_half(float f);
float rpl_bf16_to_float(uint16_t b);
uint16_t rpl_float_to_bf16(float f);

#endif /* RPL_KERNELS_H */
