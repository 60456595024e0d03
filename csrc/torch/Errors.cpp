// Errors: see Errors.hpp.
#include "Errors.hpp"

#include <c10/util/Exception.h>

#include <cstdio>

namespace ripples {

void throwStatus(rpl_status st, const std::string& msg) {
  switch (st) {
    case RPL_ERR_INVALID:
    case RPL_ERR_MISMATCH:
      C10_THROW_ERROR(ValueError, msg);
    case RPL_ERR_UNSUPPORTED:
      C10_THROW_ERROR(TypeError, msg);
    case RPL_ERR_TIMEOUT:
    case RPL_ERR_PEER:
    case RPL_ERR_ABORTED:
    case RPL_ERR_SYSTEM:
      C10_THROW_ERROR(DistBackendError, msg);
    case RPL_ERR_NOMEM:
      C10_THROW_ERROR(Error, msg);
    case RPL_ERR_CLOSED:
    default:
      C10_THROW_ERROR(Error, msg);
  }
}

std::exception_ptr statusError(rpl_status st, const std::string& msg) {
  try {
    throwStatus(st, msg);
  } catch (...) {
    return std::current_exception();
  }
}

std::string closedMessage(const std::string& group, const std::string& opName) {
  return "ripples " + opName + ": the " + group +
      " has been shut down / destroyed (destroy_process_group() or shutdown() was called); "
      "create a new process group to communicate again";
}

std::string failureMessage(
    const std::string& group,
    const std::string& opName,
    rpl_status st,
    const std::string& coreMsg) {
  if (st == RPL_ERR_CLOSED) {
    return closedMessage(group, opName) + " [" + coreMsg + "]";
  }
  return "ripples " + opName + " failed on " + group + ": " + coreMsg + " (" +
      rpl_status_name(st) + ")";
}

void throwRefused(
    const std::string& group,
    const std::string& opName,
    rpl_status st,
    const std::string& coreMsg) {
  if (st == RPL_ERR_CLOSED) {
    throwStatus(st, closedMessage(group, opName) + " [" + coreMsg + "]");
  }
  throwStatus(st, "ripples " + opName + ": " + coreMsg + " (" + rpl_status_name(st) + ")");
}

void fillError(rpl_error* err, rpl_status st, const std::string& msg) {
  if (err == nullptr) {
    return;
  }
  err->code = st;
  std::snprintf(err->msg, RPL_ERRMSG_LEN, "%s", msg.c_str());
}

}  // namespace ripples
