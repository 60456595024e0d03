"""torchft's own DiLoCo as a strategy of benchmarks/digits_worker.py (--strategy
torchft_diloco): the global-DiLoCo baseline the training benchmark compares Ripples' partial
DiLoCo with. torchft is a benchmark-only dependency; this module imports it only when the
class is built."""
import socket
from datetime import timedelta

import torch.distributed as dist
import torch.nn as nn


class TorchftDiLoCo:
    """torchft's own DiLoCo (torchft.local_sgd.DiLoCo with its Manager, a Lighthouse and
    torchft's reconfigurable gloo group): the global-DiLoCo baseline of issue 28, driven as
    torchft's integration tests drive it, not re-implemented.

    Every worker is its own replica group (a group of one: group rank 0, group world size 1,
    replica id = its rank), with its own TCPStore. Rank 0 of the launch runs the Lighthouse
    with min_replicas = the world size, so every outer step's quorum is the whole world:
    global DiLoCo. The Manager's gloo group connects by host name, so across test hosts its
    all-reduce goes over the shaped link like every other strategy's traffic. Its
    use_async_quorum=False is what DiLoCo requires; init_sync=False because every worker
    starts from the same seeded model (and, after a warm-up, the same DDP-trained one), so
    there is nothing to heal at step 0. The inner optimizer is the worker's own (the same as
    every other strategy's); the outer one is ``outer_factory``'s (the worker's
    outer_optimizer_factory(args), as for Ripples).

    The warm-up (--warmup-steps, as for torch's local SGD: DDP's gradient all-reduce on the
    default group through post_localSGD_hook) comes first; DiLoCo starts after it (start()),
    so its first anchor is the warmed-up model every worker shares."""

    def __init__(self, module: nn.Module, inner_opt, args, rank: int, world: int,
                 outer_factory):
        try:
            from torchft.coordination import LighthouseServer
            from torchft.local_sgd import DiLoCo
            from torchft.manager import Manager
            from torchft.process_group import ProcessGroupGloo
        except ImportError as e:
            raise SystemExit("--strategy torchft_diloco needs torchft (a benchmark-only "
                             f"dependency: pip install 'torchft==0.2.0'): {e}")
        self._diloco_cls = DiLoCo
        self.module, self.inner, self.H = module, inner_opt, args.outer_every
        host = socket.gethostname()  # the test host's own name there (tests/_hosts.py)
        self.lighthouse = None
        addr = [None]
        if rank == 0:
            self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world,
                                               quorum_tick_ms=args.lighthouse_tick_ms)
            addr = [self.lighthouse.address()]
        dist.broadcast_object_list(addr, src=0)
        # this replica group's store: its Manager finds its ManagerServer there, and the
        # quorum's gloo group rendezvouses on the primary's (the TCPStore listens on every
        # interface; the host name is what the others are told)
        self.store = dist.TCPStore(host_name=host, port=0, is_master=True,
                                   wait_for_workers=False)
        timeout = timedelta(seconds=args.timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._load_state,
            state_dict=self._state, min_replica_size=world, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=0,
            world_size=1, store_addr=host, store_port=self.store.port,
            lighthouse_addr=addr[0], replica_id=f"replica_{rank}", port=0, hostname=host,
            init_sync=False)
        self.outer = outer_factory(module.parameters())
        self.diloco = None
        self.syncs = 0  # outer steps attempted
        self.sync_s = 0.0  # their wall time: quorum + pseudo-gradient all-reduce + outer step
        self.quorum_ids = set()
        self.payload = sum(p.numel() * p.element_size() for p in module.parameters())

    def _state(self):
        return {"model": self.module.state_dict(), "optim": self.inner.state_dict()}

    def _load_state(self, sd):  # healing a replica that fell behind (never with no faults)
        self.module.load_state_dict(sd["model"])
        self.inner.load_state_dict(sd["optim"])

    def connect(self) -> None:
        """One quorum before the training clock: it configures the Manager's gloo group (its
        connections), the counterpart of the other strategies' process group set-up, which
        is off the clock too. Later quorums of the same members keep the group."""
        self.manager.start_quorum()  # use_async_quorum=False: returns with the quorum
        self.quorum_ids.add(self.manager._quorum_id)

    def start(self) -> None:
        """DiLoCo from here on (after the warm-up): the current model is the first anchor."""
        self.diloco = self._diloco_cls(self.manager, [self.module], self.inner, self.outer,
                                       sync_every=self.H)
        self.diloco.__enter__()

    def is_sync(self, step: int, warmup: int) -> bool:
        """Whether the optimizer step of 0-based ``step`` ends with DiLoCo's outer step."""
        return self.diloco is not None and step >= warmup and (step - warmup + 1) % self.H == 0

    def record_sync(self, seconds: float) -> None:
        self.syncs += 1
        self.sync_s += seconds
        self.quorum_ids.add(self.manager._quorum_id)

    def stats(self) -> dict:
        commits = self.manager.current_step()  # outer steps that committed
        return {"rounds": self.syncs, "reduced": commits, "singletons": 0,
                "sync_s": round(self.sync_s, 4), "bytes": self.payload * commits,
                "payload_bytes": self.payload, "quorums": len(self.quorum_ids)}

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        dist.barrier()  # every Manager is done with the Lighthouse before it goes
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
