/* ripples-coordinator: the Group Generator as a standalone service, or a status query. The
 * command line (flags, help, messages) is coordinator/cli.c, shared with
 * `python -m ripples_pg.coordinator`. */
#include "rpl_coord_cli.h"

int main(int argc, char **argv) { return rpl_coord_cli_main(argc, argv); }
