"""Records the Python layer publishes in the c10d store, sealed with the job secret.

torch's store authenticates nobody: whoever can write it could name another coordinator
endpoint or another host label. With ``Options.job_secret`` every record written through a
:class:`SealedStore` ends in ``"|"`` and 32 hex digits, the first 16 bytes of
HMAC-SHA256(key, name + "\\0" + value), where the key is HMAC-SHA256(job_secret,
"ripples-store-record/1/" + job id) (the job id names the group, its size, the elastic run
and the incarnation, so a record cannot be moved to another key, group or restart either). A
reader checks the seal and raises naming the record. The C core seals its own records
(addresses, shared-memory names, the link salt) the same way (csrc/bootstrap.c). Without a
secret records stay plain: anyone who can read the store could compute a key anyway.
"""
import hashlib
import hmac
from typing import Any, Optional

_TAG_HEX = 32


class SealedStore:
    """``set``/``get`` of text records in ``store`` (sealed when ``job_secret`` is set);
    everything else is the store's own."""

    def __init__(self, store: Any, job_secret: Optional[str], job_id: str):
        self._store = store
        self._key = (hmac.new(job_secret.encode(), b"ripples-store-record/1/" + job_id.encode(),
                              hashlib.sha256).digest() if job_secret else None)

    def _tag(self, name: str, value: str) -> str:
        assert self._key is not None
        mac = hmac.new(self._key, name.encode() + b"\0" + value.encode(), hashlib.sha256)
        return mac.hexdigest()[:_TAG_HEX]

    def set(self, name: str, value: str) -> None:
        value = str(value)
        self._store.set(name, value + "|" + self._tag(name, value) if self._key else value)

    def get(self, name: str) -> str:
        """The value of record ``name`` (blocks until it exists, as the store does)."""
        raw = self._store.get(name)
        text = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
        value, bar, tag = text.rpartition("|")
        tagged = bool(bar) and len(tag) == _TAG_HEX and all(c in "0123456789abcdef" for c in tag)
        if self._key is None:
            if tagged:
                raise RuntimeError(
                    f"ripples_pg: the c10d store record {name!r} was sealed with a job secret, "
                    f"and this rank has none: set the same RIPPLES_JOB_SECRET (or "
                    f"Options(job_secret=...)) on every rank")
            return text
        if not tagged or not hmac.compare_digest(tag, self._tag(name, value)):
            why = "fails its MAC with the job secret" if tagged else "carries no MAC"
            raise RuntimeError(
                f"ripples_pg: the c10d store record {name!r} {why}: it was not written by a "
                f"rank holding this job's secret (a rank started without RIPPLES_JOB_SECRET or "
                f"with another one, or someone else wrote the c10d store)")
        return value

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._store, attr)
