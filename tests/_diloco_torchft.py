"""One torchft replica group (one process) running torchft's own DiLoCo on the shared model
and data of tests/_diloco_common.py; writes the parameters after every outer step to a file.

    python _diloco_torchft.py REPLICA_ID LIGHTHOUSE_ADDR H ROUNDS OUT_PATH
"""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import _diloco_common as C


def main():
    rid, lighthouse, H, rounds, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5]
    torch.set_num_threads(1)
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    # this replica group's own store (one rank per replica group)
    store = dist.TCPStore("localhost", 0, 1, True, wait_for_workers=False)
    model = C.make_model()
    inner = C.make_inner(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        min_replica_size=2, use_async_quorum=False,
        init_sync=False,  # identical seeded models: no step-0 healing from a peer
        load_state_dict=None, state_dict=None,
        replica_id=rid, store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, port=0,
        timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30))
    rank = int(rid)
    out = []
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=H,
                    backup_device=torch.device("cpu"), pin_memory=False):
            for step in range(H * rounds):
                x, y = C.batch(rank, step)
                inner.zero_grad()
                C.loss_of(model, x, y).backward()
                inner.step()  # DiLoCo's post-hook syncs every H steps
                if (step + 1) % H == 0:
                    out.append(C.flat_params(model))
        torch.save({"params": out, "manager_step": manager.current_step()}, out_path)
    finally:
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
