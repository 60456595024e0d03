/* transport_frame.c - the frame header every message on a link starts with (see transport.h):
 * its encoding, and the checks a receiver makes against what it expects, which turn ranks
 * that called different operations into a clear error. Pure functions. */
#include <string.h>

#include "bytes.h"
#include "common.h"
#include "transport_internal.h"

void rpl_tr_frame_key(const rpl_tr *tr, conn *c, const unsigned char *hs1,
                      const unsigned char *hs2) {
  static const char label[] = "ripples-frames/1";
  const void *parts[3] = {label, hs1, hs2};
  size_t lens[3] = {sizeof label - 1, RPL_HS1_SIZE, RPL_HS2_SIZE};
  rpl_hmac_sha256(tr->key, sizeof tr->key, parts, lens, 3, c->fkey);
  c->tx_frames = c->rx_frames = 0;
  c->rx_tag_got = 0;
  c->rx_tag_ok = 0;
}

void rpl_tr_frame_mac_begin(rpl_hmac *m, const conn *c, int sender, uint64_t n,
                            const unsigned char h[HDR_SIZE]) {
  unsigned char pre[12];
  rpl_put32(pre, (uint32_t)sender); /* a frame reflected back to its sender fails */
  rpl_put64(pre + 4, n);            /* ... and one replayed, dropped or reordered */
  rpl_hmac_init(m, c->fkey, sizeof c->fkey);
  rpl_hmac_update(m, pre, sizeof pre);
  rpl_hmac_update(m, h, HDR_SIZE);
}

void rpl_tr_encode_header(unsigned char h[HDR_SIZE], const rpl_meta *m, uint64_t len) {
  rpl_put32(h, DATA_MAGIC);
  h[4] = m->op;
  h[5] = m->dtype;
  rpl_put16(h + 6, m->step);
  rpl_put32(h + 8, m->tag);
  rpl_put64(h + 16, m->seq);
  rpl_put64(h + 24, m->count);
  rpl_put64(h + 32, len);
}

void rpl_tr_decode_header(const unsigned char *h, uint32_t *magic, rpl_meta *m, uint64_t *len) {
  *magic = rpl_get32(h);
  m->op = h[4];
  m->dtype = h[5];
  m->step = rpl_get16(h + 6);
  m->tag = rpl_get32(h + 8);
  m->seq = rpl_get64(h + 16);
  m->count = rpl_get64(h + 24);
  *len = rpl_get64(h + 32);
}

rpl_status rpl_tr_check_header(const rpl_tr *tr, int peer, const rpl_xfer *x, uint32_t magic,
                               const rpl_meta *m, uint64_t len, rpl_error *err) {
  const rpl_meta *e = &x->meta;
  if (magic != DATA_MAGIC)
    return rpl_fail(err, RPL_ERR_PEER, "corrupt message header from rank %d", peer);
  if (m->op == RPL_OP_SEND && (e->op != RPL_OP_SEND || m->tag != e->tag))
    return RPL_OK; /* a p2p message for a later recv: the caller stashes it */
  if (m->op == RPL_OP_SEND) {
    /* Point-to-point moves raw bytes, as gloo does: only the size must agree. */
    if (len != x->len) return rpl_tr_p2p_size_mismatch(peer, x, len, err);
    return RPL_OK;
  }
  if (e->op == RPL_OP_SEND && m->op != RPL_OP_SEND)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "rank %d sent its %s #%llu while this rank waits in recv(src=%d, tag=%u): "
                    "ranks issued operations in different orders", peer,
                    rpl_op_name((rpl_op_kind)m->op), (unsigned long long)m->seq, peer, e->tag);
  /* The messages name both ranks, the lower first, and not "this rank": a peer that learns
   * of the mismatch from the rank that found it raises the same text. */
  int lo = RPL_MIN(peer, tr->rank), hi = RPL_MAX(peer, tr->rank);
  const rpl_meta *ml = peer < tr->rank ? m : e, *mh = peer < tr->rank ? e : m;
  if (m->op != e->op || m->seq != e->seq)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "collective mismatch: rank %d is in %s #%llu, rank %d in %s #%llu (ranks "
                    "called different collectives, or in a different order)",
                    lo, rpl_op_name((rpl_op_kind)ml->op), (unsigned long long)ml->seq, hi,
                    rpl_op_name((rpl_op_kind)mh->op), (unsigned long long)mh->seq);
  if (m->dtype != e->dtype)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "dtype mismatch in %s #%llu: rank %d has %s tensors, rank %d has %s",
                    rpl_op_name((rpl_op_kind)e->op), (unsigned long long)e->seq, lo,
                    rpl_dtype_name((rpl_dtype)ml->dtype), hi,
                    rpl_dtype_name((rpl_dtype)mh->dtype));
  if (m->tag != e->tag && e->op != RPL_OP_SEND)
    return rpl_fail(err, RPL_ERR_MISMATCH, "%s #%llu: rank %d passed %u tensors, rank %d %u",
                    rpl_op_name((rpl_op_kind)e->op), (unsigned long long)e->seq, lo, ml->tag,
                    hi, mh->tag);
  if (e->count != RPL_ANY_COUNT && m->count != e->count)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "size mismatch in %s #%llu: rank %d has %llu elements, rank %d has %llu "
                    "(tensor %u; every rank must pass tensors of the same size)",
                    rpl_op_name((rpl_op_kind)e->op), (unsigned long long)e->seq, lo,
                    (unsigned long long)ml->count, hi, (unsigned long long)mh->count, e->step);
  if (m->step != e->step || len != x->len)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "size mismatch in %s #%llu: rank %d sends %llu bytes, this rank expects "
                    "%zu (split sizes or tensor sizes differ across ranks)",
                    rpl_op_name((rpl_op_kind)e->op), (unsigned long long)e->seq, peer,
                    (unsigned long long)len, x->len);
  return RPL_OK;
}
