// Config: see Config.hpp. The only place that turns the backend's configuration into the
// core's structs, and its Python binding.
#include "Config.hpp"

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

namespace py = pybind11;

namespace ripples {

namespace {

// Options(single_copy=True): all-reduce buffers from this size read peers' memory directly
// (below it the handshake costs more than the copies it saves).
constexpr size_t kSingleCopyBytes = 256 * 1024;

const char* orNull(const std::string& s) {
  return s.empty() ? nullptr : s.c_str();
}

// The rpl_compress of a compression name (rpl_compress_name, ripples.h); -1 if none.
int compressionMode(const std::string& name) {
  for (int i = 0; i < RPL_COMPRESS_COUNT; i++) {
    if (name == rpl_compress_name(static_cast<rpl_compress>(i))) {
      return i;
    }
  }
  return -1;
}

}  // namespace

void checkConfig(const Config& cfg, int size) {
  TORCH_CHECK_VALUE(
      cfg.timeout_s > 0, "ripples: timeout must be > 0 seconds, got ", cfg.timeout_s);
  TORCH_CHECK_VALUE(compressionMode(cfg.compression) >= 0, "ripples: unknown compression '",
                    cfg.compression, "' (none, bf16, fp16 or int8)");
  // Options validates it; the bounds keep a chunk at least one element of any dtype.
  TORCH_CHECK_VALUE(
      cfg.stage_chunk_bytes == 0 ||
          (cfg.stage_chunk_bytes >= 8 && cfg.stage_chunk_bytes <= (size_t{1} << 30)),
      "ripples: stage_chunk_bytes=", cfg.stage_chunk_bytes,
      " is out of range (0, or 8 to 1 GiB)");
  TORCH_CHECK_VALUE(
      cfg.schedule.empty() || cfg.host_of.empty() ||
          cfg.host_of.size() == static_cast<size_t>(size),
      "ripples: host_of has ", cfg.host_of.size(), " entries for a group of ", size);
}

rpl_comm_config commConfig(const Config& cfg, int rank, int size) {
  rpl_comm_config cc;
  std::memset(&cc, 0, sizeof(cc));
  cc.rank = rank;
  cc.size = size;
  cc.timeout_s = cfg.timeout_s;
  cc.bind_addr = orNull(cfg.bind_addr);
  cc.job_secret = cfg.job_secret.c_str();
  cc.name = orNull(cfg.name);
  cc.small_bytes = cfg.small_bytes;
  cc.chunk_bytes = cfg.chunk_bytes;
  cc.host_key = orNull(cfg.host_key);
  cc.tcp_only = cfg.tcp_only ? 1 : 0;
  cc.use_ucx = cfg.use_ucx ? 1 : 0;
  cc.single_copy_bytes = cfg.single_copy ? kSingleCopyBytes : 0;
  cc.frame_macs = cfg.frame_macs ? 1 : 0;
  return cc;
}

rpl_partial_config partialConfig(const Config& cfg, rpl_domain* domain) {
  rpl_partial_config pc;
  std::memset(&pc, 0, sizeof(pc));
  pc.schedule = cfg.schedule.c_str();
  pc.host_of = cfg.host_of.empty() ? nullptr : cfg.host_of.data();
  pc.endpoint = orNull(cfg.endpoint);
  pc.token_hex = orNull(cfg.token);
  pc.on_failure = cfg.on_failure_skip ? RPL_ON_FAILURE_SKIP : RPL_ON_FAILURE_RAISE;
  pc.trace = cfg.trace ? 1 : 0;
  pc.domain = domain;
  pc.compression = static_cast<rpl_compress>(compressionMode(cfg.compression));
  return pc;
}

void bindConfig(py::module_& m) {
  py::class_<Config> c(m, "Config",
                       "The backend's configuration (shim/Config.hpp); filled by "
                       "ripples_pg.Options._core_config and the creator, never printed (it "
                       "holds the job secret).");
  c.def(py::init<>());
  py::list fields;
#define RIPPLES_CONFIG_BIND(type, field, dflt, doc) \
  c.def_readwrite(#field, &Config::field, doc);      \
  fields.append(#field);
  RIPPLES_CONFIG_FIELDS(RIPPLES_CONFIG_BIND)
#undef RIPPLES_CONFIG_BIND
  c.attr("FIELDS") = py::tuple(fields);
}

}  // namespace ripples
