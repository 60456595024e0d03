"""A byte-forwarding relay on the path to a coordinator, for the tests that play someone on
that path: an attacker without the token (test_coord_security.py, issue 51's review), or a
network that loses what a coordinator sends just before it dies (test_failover.py)."""
from __future__ import annotations

import threading

import zmq


class Relay:
    """Each client connection gets its own connection upstream under the same routing id;
    `sent` records what the clients sent, in order. `on_route` is called with each new routing
    id before it is forwarded; `drop_reply(raw)`, when given, is asked about each reply of the
    coordinator, which is not forwarded when it returns true."""

    def __init__(self, upstream, on_route=None, drop_reply=None):
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.front.bind_to_random_port('tcp://127.0.0.1')}"
        self.upstream, self.up, self.sent = upstream, {}, []
        self.on_route, self.drop_reply = on_route, drop_reply
        self.stop = threading.Event()
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self):
        while not self.stop.is_set():
            poller = zmq.Poller()
            poller.register(self.front, zmq.POLLIN)
            for s in self.up.values():
                poller.register(s, zmq.POLLIN)
            for sock, _ in poller.poll(20):
                if sock is self.front:
                    route, raw = self.front.recv_multipart()
                    if route not in self.up:
                        if self.on_route is not None:
                            self.on_route(route)
                        s = self.ctx.socket(zmq.DEALER)
                        s.setsockopt(zmq.LINGER, 0)
                        s.setsockopt(zmq.ROUTING_ID, route)
                        s.connect(self.upstream)
                        self.up[route] = s
                    self.sent.append(raw)
                    self.up[route].send(raw)
                else:
                    route = next(r for r, s in self.up.items() if s is sock)
                    raw = sock.recv()
                    if self.drop_reply is None or not self.drop_reply(raw):
                        self.front.send_multipart([route, raw])

    def close(self):
        self.stop.set()
        self.th.join(10)
        for s in self.up.values():
            s.close(0)
        self.front.close(0)
        self.ctx.term()
