"""`ShardWorker`: the Ray actor that owns one device and runs one shard's `ModelRunner`.

`RayExecutor` is the engine side of a one-shard group: it places the actor (a GPU when the device is CUDA, else
one CPU), waits until the model and KV pool are up, and forwards each step. A step costs one actor round trip
(about 1 ms on the GPU machine), which is why the engine runs a lone shard in-process by default; the actor path
is what multi-shard groups build on (`workers.group.WorkerGroup`).

A shard of a multi-rank group starts in two calls, because its peers must exist before any of them can join
the process group: rank 0 opens the rendezvous store on a free port of its own node (`open_rendezvous`), then
every rank joins it (`start`: `init_parallel`, then this rank's weight slices and KV pool).
"""
from __future__ import annotations

import os
import pickle
import socket
from datetime import timedelta
from pathlib import Path

import ray

from workers.batch import StepBatch
from workers.config import EngineConfig, ParallelConfig
from workers.runner import ModelRunner, StepResult


class ShardWorker:
    """One shard: model weights and KV pages on this actor's device.

    With `parallel` None (or a world of one) the model loads in the constructor, as a lone shard. Otherwise the
    constructor only records the rank; `open_rendezvous` (rank 0) and `start` (every rank) bring it up."""

    def __init__(self, model_dir: str, engine_config: EngineConfig, device: str = "auto", *, rank: int = 0,
                 parallel: ParallelConfig | None = None, moe_dispatch: str = "alltoall",
                 collective_timeout_s: float = 600.0) -> None:
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model_dir = model_dir
        self.engine_config = engine_config
        self.device = device
        self.rank = rank
        self.parallel = parallel or ParallelConfig()
        self.moe_dispatch = moe_dispatch
        self.collective_timeout_s = collective_timeout_s
        self.ctx = None
        self.runner: ModelRunner | None = None
        self._store = None
        self._listen_socket: socket.socket | None = None
        self.num_calls = 0  # group steps this rank ran (one Ray call each)
        if self.parallel.world_size == 1:
            self.runner = ModelRunner(model_dir, engine_config=engine_config, device=device)

    # ---- group start ------------------------------------------------------------------------------------
    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0: listen on a free port of this node's address and serve the group's TCPStore there.
        -> (host, port) for the other ranks. The socket is bound by us and handed to the store, so no other
        process can take the port between finding it and using it, and it listens on this node's address only
        (loopback on a single-node test cluster), not on every interface."""
        from torch.distributed import TCPStore

        host = ray.util.get_node_ip_address()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(128)
        self._listen_socket = sock
        port = sock.getsockname()[1]
        self._store = TCPStore(host, port, self.parallel.world_size, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=self.collective_timeout_s),
                               master_listen_fd=sock.fileno())
        return host, port

    def start(self, host: str, port: int) -> dict:
        """Join the group's process groups through the store at host:port, then load this rank's weight slices
        and allocate its KV pool. -> `info()`."""
        import torch
        from torch.distributed import TCPStore

        from msa.parallel import init_parallel

        p = self.parallel
        store = self._store
        if store is None:
            store = TCPStore(host, port, p.world_size, is_master=False,
                             timeout=timedelta(seconds=self.collective_timeout_s))
        device = self.device
        backend = "nccl" if str(device).startswith("cuda") else "gloo"
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            _gloo_on_loopback(host)
        self.ctx = init_parallel(self.rank, p.world_size, tp=p.tp, ep=p.ep, dp=p.dp, store=store, backend=backend,
                                 moe_dispatch=self.moe_dispatch, timeout_s=self.collective_timeout_s, device=device)
        self.runner = ModelRunner(self.model_dir, engine_config=self.engine_config, device=device, ctx=self.ctx)
        return self.info()

    # ---- steps ------------------------------------------------------------------------------------------
    def info(self) -> dict:
        return self.runner.info()

    def execute(self, batch: StepBatch) -> StepResult:
        return self.runner.execute(batch)

    def execute_pickled(self, payload: bytes) -> StepResult | None:
        """A step whose batch the engine pickled once for every rank of the group. Only a sampling rank (tp
        rank 0) returns its result; the others return None (nothing the engine reads, nothing to send back)."""
        self.num_calls += 1
        result = self.runner.execute(pickle.loads(payload))
        return result if self.runner.samples else None

    def counters(self) -> dict:
        """{"calls": group steps run, "idle_forwards": empty forwards run for lockstep peers} (tests)."""
        return {"calls": self.num_calls, "idle_forwards": self.runner.num_idle_forwards}

    def ping(self) -> str:
        return "ok"

    def stop(self) -> None:
        """Leave the process group cleanly (all ranks call this together)."""
        from msa.parallel import destroy_parallel

        if self.ctx is not None:
            destroy_parallel(self.ctx)
            self.ctx = None


def _gloo_on_loopback(host: str) -> None:
    """A group met on a loopback address keeps its gloo connections there too (gloo otherwise binds the
    address this host's name resolves to). An explicit GLOO_SOCKET_IFNAME wins."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or not (host.startswith("127.") or host == "::1"):
        return
    names = [name for _i, name in socket.if_nameindex()]
    if "lo" in names:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


class RayExecutor:
    """Runs the engine's steps on one `ShardWorker` actor."""

    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig, device: str = "cpu",
                 actor_options: dict | None = None) -> None:
        if not ray.is_initialized():
            raise RuntimeError("executor: 'ray' needs ray.init() first")
        opts = {"num_gpus": 1, "num_cpus": 1} if device.startswith("cuda") else {"num_cpus": 1}
        opts.update(actor_options or {})
        # The actor sees its own GPU as cuda:0 (Ray sets CUDA_VISIBLE_DEVICES).
        actor_device = "cuda" if device.startswith("cuda") else device
        self.actor = ray.remote(ShardWorker).options(**opts).remote(str(model_dir), engine_config, actor_device)
        self._info = ray.get(self.actor.info.remote())  # surfaces a failed start here, with its traceback

    def info(self) -> dict:
        return self._info

    def execute(self, batch: StepBatch) -> StepResult:
        return ray.get(self.actor.execute.remote(batch))

    def shutdown(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None
