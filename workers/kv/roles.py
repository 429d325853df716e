"""Which connector a role's engine core gets (`make_connector`)."""
from __future__ import annotations

from collections.abc import Sequence

from workers.kv.config import TransferConfig
from workers.kv.connector import KVConnector
from workers.kv.handoff import PrefillConnector
from workers.kv.remote import DecodeConnector


def make_connector(role: str, agents: Sequence = (), config: TransferConfig | None = None) -> KVConnector:
    """Prefill and decode move KV over `agents` (one per engine core); unified has no transfers."""
    if role == "prefill":
        return PrefillConnector(agents, role=role, config=config)
    if role == "decode":
        return DecodeConnector(agents, role=role, config=config)
    return KVConnector(role=role, config=config)
