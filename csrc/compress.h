/*
 * compress.h - quantisers of compressed partial rounds (internal to csrc/; docs/compression.md).
 *
 * Pure functions over float32 arrays, no I/O, so they are unit-tested on their own
 * (tests/c/test_compress.c). An encoding of n floats is rpl_cq_size(mode, n) bytes, always a
 * multiple of 4 (so that encodings placed one after another stay aligned):
 *
 *   bf16, fp16  n 16-bit values, round to nearest even (then zero padding).
 *   int8        one float32 scale per block of RPL_CQ_BLOCK elements (the block's largest
 *               magnitude / 127), then n int8 values round(x / scale) in [-127, 127] (then zero
 *               padding). |x - decoded| <= absmax_block / 254, plus float32 rounding (a few
 *               units in the last place of absmax_block).
 *
 * Encoders take finite values within rpl_cq_limit(mode) (the round checks that first, see
 * rpl_cq_in_range); as a last defence they saturate to the format's largest finite value
 * instead of producing an inf. Decoders check what a peer sent: a non-finite value or scale,
 * an int8 of -128, or a magnitude beyond `bound` makes them fail, never yield inf/NaN.
 */
#ifndef RPL_COMPRESS_H
#define RPL_COMPRESS_H

#include <stddef.h>
#include <stdint.h>

#include "ripples.h"

#define RPL_CQ_BLOCK 128

/* Bytes of the encoding of n floats (0 for n == 0 or an unknown mode). */
size_t rpl_cq_size(rpl_compress mode, size_t n);

/* The largest magnitude a compressed round accepts: 32752 for fp16 (half its range, so that a
 * member's difference to the average, |avg - q| <= 2 * limit, is representable too), 2^100
 * otherwise (sums of many members and differences stay far from float32 overflow). */
float rpl_cq_limit(rpl_compress mode);

/* 1 when every x[i] is finite with |x[i]| <= limit. */
int rpl_cq_in_range(const float *x, size_t n, float limit);

/* Encodes x[0..n) into out (rpl_cq_size(mode, n) bytes). */
void rpl_cq_encode(rpl_compress mode, const float *x, size_t n, void *out);

/* Decodes n floats from `in` into out. Returns 0, or -1 when the encoding holds a non-finite
 * value or scale, an int8 of -128, or a value beyond `bound` (then out is unspecified). */
int rpl_cq_decode(rpl_compress mode, const void *in, size_t n, float bound, float *out);

/* rpl_cq_encode, then y[i] -= decoded[i]: y becomes the quantisation error (the residual of
 * error feedback), in the same pass over the data. */
void rpl_cq_encode_residual(rpl_compress mode, float *y, size_t n, void *out);

/* The conversions the 16-bit modes use (finite inputs; |f| <= 65504 for half), for tests. */
uint16_t rpl_cq_to_half(float f);
float rpl_cq_from_half(uint16_t h);
uint16_t rpl_cq_to_bf16(float f);

#endif /* RPL_COMPRESS_H */
