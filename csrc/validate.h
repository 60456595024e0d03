/*
 * validate.h - argument checks of an operation before it is queued (internal to csrc/).
 *
 * Everything a rank can tell on its own (buffer lists, dtypes, counts, roots, tags) fails
 * here with RPL_ERR_INVALID or RPL_ERR_UNSUPPORTED, before any data moves; what needs the
 * peers (matching calls and sizes) is checked by the message headers (transport.h).
 */
#ifndef RPL_VALIDATE_H
#define RPL_VALIDATE_H

#include "ripples.h"

/* `d` as submitted on rank `rank` of a communicator of `size`; `has_partial`: partial rounds
 * are enabled on it. */
rpl_status rpl_validate(const rpl_op_desc *d, int rank, int size, int has_partial,
                        rpl_error *err);

#endif /* RPL_VALIDATE_H */
