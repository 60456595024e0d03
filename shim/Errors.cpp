// Errors: see Errors.hpp.
#include "Errors.hpp"

#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <cstdio>

namespace ripples {

namespace {

enum class Exc { kValue, kType, kDistBackend, kTimeout, kConnection, kMemory, kRuntime };

struct StatusRow {
  rpl_status status;
  Exc backend;
  Exc coordinator;
};

// The one status-to-exception table; a status not listed raises kRuntime.
constexpr StatusRow kTable[] = {
    {RPL_ERR_INVALID, Exc::kValue, Exc::kValue},
    {RPL_ERR_MISMATCH, Exc::kValue, Exc::kRuntime},
    {RPL_ERR_UNSUPPORTED, Exc::kType, Exc::kRuntime},
    {RPL_ERR_TIMEOUT, Exc::kDistBackend, Exc::kTimeout},
    {RPL_ERR_PEER, Exc::kDistBackend, Exc::kConnection},
    {RPL_ERR_ABORTED, Exc::kDistBackend, Exc::kRuntime},
    {RPL_ERR_SYSTEM, Exc::kDistBackend, Exc::kRuntime},
    {RPL_ERR_NOMEM, Exc::kRuntime, Exc::kMemory},
};

Exc lookup(StatusUser user, rpl_status st) {
  for (const StatusRow& row : kTable) {
    if (row.status == st) {
      return user == StatusUser::kBackend ? row.backend : row.coordinator;
    }
  }
  return Exc::kRuntime;
}

// torch's types: its pybind11 translator turns them into the Python exceptions.
[[noreturn]] void throwTorch(Exc e, const std::string& msg) {
  switch (e) {
    case Exc::kValue:
      C10_THROW_ERROR(ValueError, msg);
    case Exc::kType:
      C10_THROW_ERROR(TypeError, msg);
    case Exc::kDistBackend:
      C10_THROW_ERROR(DistBackendError, msg);
    default:
      C10_THROW_ERROR(Error, msg);
  }
}

[[noreturn]] void throwPython(Exc e, const std::string& msg) {
  PyObject* type = PyExc_RuntimeError;
  switch (e) {
    case Exc::kValue: type = PyExc_ValueError; break;
    case Exc::kTimeout: type = PyExc_TimeoutError; break;
    case Exc::kConnection: type = PyExc_ConnectionError; break;
    case Exc::kMemory: type = PyExc_MemoryError; break;
    default: break;
  }
  pybind11::set_error(type, msg.c_str());
  throw pybind11::error_already_set();
}

}  // namespace

void throwStatus(StatusUser user, rpl_status st, const std::string& msg) {
  if (user == StatusUser::kBackend) {
    throwTorch(lookup(user, st), msg);
  }
  throwPython(lookup(user, st), msg);
}

void throwStatus(rpl_status st, const std::string& msg) {
  throwStatus(StatusUser::kBackend, st, msg);
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
