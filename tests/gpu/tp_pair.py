"""Two processes on two GPUs as one TP group (NCCL, the lent machines' settings: no NVLink multicast), for the
multi-GPU kernel tests and benches: ``run_pair(fn, *args)`` runs ``fn(rank, world, *args)`` in each and returns what
each returned (pickled through a file)."""

from __future__ import annotations

import os
import pickle
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.arfuse_check import SAFE  # every multicast switch off (and FlashInfer's all-reduce on trtllm)
from tests.server import free_port


def _entry(rank: int, world: int, port: int, out: str, fn, args) -> None:
    os.environ.update(SAFE, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        result = fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)


def run_pair(fn, *args, world: int = 2) -> list:
    """``[fn(0, world, *args), fn(1, world, *args), ...]``, each rank in its own process on its own GPU."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_entry, args=(world, free_port(), out, fn, args), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(out, f"rank{rank}.pkl"), "rb") as fh:
                results.append(pickle.load(fh))
    return results
