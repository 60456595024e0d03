/*
 * bootstrap.h - connects a new communicator's transport to its peers (internal to csrc/).
 *
 * Runs once, on the creating thread, through the caller's key-value store: every rank
 * publishes under "ripples/..." keys and reads every peer's (each get waits for its key).
 */
#ifndef RPL_BOOTSTRAP_H
#define RPL_BOOTSTRAP_H

#include "ripples.h"
#include "transport.h"

/* For rank cfg->rank of cfg->size: sets the link key (rank 0's salt keyed with the job
 * secret), gives `tr` every peer's address, fills same_host[0..size) (1 for the ranks that
 * share this host) and, unless cfg->tcp_only, hands `tr` shared-memory rings to them. On
 * failure the caller destroys `tr`, which owns whatever was set up. */
rpl_status rpl_bootstrap(rpl_tr *tr, const rpl_comm_config *cfg, const rpl_store *store,
                         unsigned char *same_host, rpl_error *err);

#endif /* RPL_BOOTSTRAP_H */
