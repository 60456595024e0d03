// Config: the backend's configuration, one object from Python to the core.
//
// ripples_pg/backend/options.py fills it (Options._core_config; backend/_register.py adds what
// it found at creation: timeout, address, hosts, coordinator), module.cpp hands it to the
// backend, and Config.cpp alone turns it into the core's structs. Adding an option therefore
// touches options.py, this file's field list, Config.cpp's conversion, and the core if it needs
// one.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "ripples.h"

namespace ripples __attribute__((visibility("hidden"))) {

// X(type, field, default, doc): one line per field. Python sees each as a read-write attribute
// of ripples_pg._C.Config, in this order (Config.FIELDS).
#define RIPPLES_CONFIG_FIELDS(X)                                                             \
  X(double, timeout_s, 1800.0, "per operation, in seconds; > 0")                            \
  X(std::string, bind_addr, "", "IPv4 address peers connect to; empty = 127.0.0.1")         \
  X(std::string, name, "", "short label for messages and thread names")                    \
  X(size_t, small_bytes, 0, "0 = core default")                                             \
  X(size_t, chunk_bytes, 0, "0 = core default")                                             \
  X(std::string, host_key, "", "ranks with equal keys share memory; empty = this machine") \
  X(bool, tcp_only, false, "never use shared memory")                                       \
  X(bool, use_ucx, false, "UCX instead of TCP across hosts")                               \
  X(bool, single_copy, false, "large all-reduces read local peers' memory directly")       \
  X(bool, inline_small, true, "small collectives run on the caller's thread when idle")    \
  X(std::string, job_secret, "", "keys link authentication (never printed)")               \
  X(bool, frame_macs, false, "a MAC on every data frame of the TCP links")                 \
  X(std::string, schedule, "", "partial-round schedule; empty = partial rounds off")       \
  X(std::vector<int>, host_of, {}, "dense host index of every group rank")                  \
  X(std::string, endpoint, "", "coordinator endpoint list (dynamic schedules)")             \
  X(std::string, token, "", "the job's coordinator token (never printed)")                 \
  X(bool, on_failure_skip, false, "a failed partial round is skipped, not raised")         \
  X(bool, trace, false, "keep a per-round trace")                                           \
  X(bool, partial_by_default, false, "allreduce is a partial round without partial()")     \
  X(std::string, compression, "none", "partial rounds' wire format: none, bf16, fp16, int8") \
  X(size_t, stage_chunk_bytes, 0, "staged all-reduces/broadcasts pipeline in such chunks; 0 = whole")

struct Config {
#define RIPPLES_CONFIG_MEMBER(type, field, dflt, doc) type field = dflt;
  RIPPLES_CONFIG_FIELDS(RIPPLES_CONFIG_MEMBER)
#undef RIPPLES_CONFIG_MEMBER
};

// Raises ValueError for a configuration no core struct can take (a size of `size` ranks).
void checkConfig(const Config& cfg, int size);
// The core's communicator configuration. Its strings point into cfg: keep cfg alive.
rpl_comm_config commConfig(const Config& cfg, int rank, int size);
// The core's partial-round configuration (cfg.schedule non-empty). Strings point into cfg.
rpl_partial_config partialConfig(const Config& cfg, rpl_domain* domain);

}  // namespace ripples
