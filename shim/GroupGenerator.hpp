// GroupGenerator: the Python binding of the Group Generator (the submodule ripples_pg._C.gg,
// which ripples_pg/backend/_gg.py re-exports): the static schedule, the policy state machine, the
// coordinator service, its client and the ripples-coordinator command line.
#pragma once

#include <pybind11/pybind11.h>

namespace ripples {

// Adds the submodule "gg" to m.
void bindGroupGenerator(pybind11::module_& m);

} // namespace ripples
