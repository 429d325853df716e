"""KV transfer between prefill and decode instances (docs/disaggregation.md). Today: the tp group's agent
(`group_agent.py`); workers/transfer.py, transport.py and nccl.py move here, split by concern (issue 19)."""
