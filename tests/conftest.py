"""Shared fixtures for the multi-process tests.

The backend under test is "ripples" unless ``RIPPLES_TEST_BACKEND`` names another one (the
harness was developed against gloo-vs-gloo). Reference results always come from "gloo".
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _dist  # noqa: E402


def pytest_report_header(config):
    return f"ripples_pg tests: backend under test {_dist.BACKEND!r}, reference {_dist.REF_BACKEND!r}"


class _PoolManager:
    """Keeps at most one worker pool alive per pytest process and reuses it across tests
    with the same world size (tests are grouped by world size through module-scoped
    parametrisation). A pool that failed is replaced on next use."""

    def __init__(self):
        self.pool = None

    def get(self, ws):
        if self.pool is not None and (self.pool.ws != ws or self.pool.broken):
            self.pool.close()
            self.pool = None
        if self.pool is None:
            self.pool = _dist.WorkerPool(ws)
        return self.pool

    def close(self):
        if self.pool is not None:
            self.pool.close()
            self.pool = None


@pytest.fixture(scope="session")
def _pool_manager():
    mgr = _PoolManager()
    yield mgr
    mgr.close()


@pytest.fixture
def pool(ws, _pool_manager):
    """A started pool of ``ws`` processes (default group = backend under test, ``ctx.ref`` =
    gloo over the same ranks)."""
    return _pool_manager.get(ws)
