#!/usr/bin/env python3
"""Issue 40's arfuse check, before any server: FlashInfer as vLLM 0.26 sees it (``has_flashinfer()``, the comm
module, the all-reduce backend pinned to ``trtllm``), its trtllm_comm JIT module built into the shared cache (the
servers' ranks then load it instead of compiling it inside their start-up), and, on 2 GPUs, FlashInfer's fused
all-reduce + residual add + RMSNorm (the kernel vLLM's AllReduceFusionPass puts in place of all_reduce ->
fused_add_rms_norm) on the workspace vLLM creates (trtllm backend: CUDA IPC through PyTorch symmetric memory, multicast
off), against NCCL's all-reduce and the same add + norm in float32 torch.
    bash bench/gpu_session.sh arfuse-check     (GPU machine, after install and fi-install)
    python3 bench/arfuse_check.py --jit-only DONE   (the JIT build alone; touches DONE when the module loads)
Refuses to create a workspace unless every multicast switch is off (KINDS.md: multicast can take the host's GPUs out
of service for a day)."""

from __future__ import annotations

import os
import sys
import time

SAFE = {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1"}
HIDDEN, EPS, TOKENS = 4096, 1e-5, (1, 16, 128, 1024)  # the 8b shape; decode batches and a prefill chunk


def unsafe() -> list[str]:
    return [f"{k}={os.environ.get(k)!r} (want {v})" for k, v in SAFE.items() if os.environ.get(k) != v]


def rank_main(rank: int, world: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    import flashinfer.comm as fc
    from flashinfer.comm.mnnvl import TorchDistBackend

    group = dist.group.WORLD
    # vLLM's call (device_communicators/flashinfer_all_reduce.py _create_workspace), its backend pinned to trtllm
    ws = fc.create_allreduce_fusion_workspace(backend="trtllm", world_size=world, rank=rank,
                                              max_token_num=max(TOKENS), hidden_dim=HIDDEN, dtype=torch.bfloat16,
                                              comm_backend=TorchDistBackend(group=group), group=group)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1234)  # the same residual and gamma on every rank
    for n in TOKENS:
        x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(rank * 1000 + n))
        residual = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        gamma = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).to(torch.bfloat16)
        summed = x.float()
        dist.all_reduce(summed)  # NCCL, float32: the reference sum
        h = summed + residual.float()
        want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * gamma.float()
        norm_out, res_out = torch.empty_like(x), torch.empty_like(x)
        fc.allreduce_fusion(input=x.clone(), workspace=ws, pattern=fc.AllReduceFusionPattern.kARResidualRMSNorm,
                            launch_with_pdl=True, trigger_completion_at_end=True, residual_out=res_out,
                            norm_out=norm_out, residual_in=residual, rms_gamma=gamma, rms_eps=EPS, fp32_acc=True)
        torch.cuda.synchronize()
        rows.append((n, (res_out.float() - h).abs().max().item(), h.abs().max().item(),
                     (norm_out.float() - want).abs().max().item(), want.abs().max().item()))
    if rank == 0:
        out.put({"backend": ws.backend, "rows": rows})
    ws.destroy()
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    t0 = time.time()
    if bad := unsafe():
        print("refusing: multicast not ruled out:", ", ".join(bad))
        return 8
    import torch
    import vllm.envs as envs
    from vllm.platforms import current_platform
    from vllm.utils.flashinfer import has_flashinfer, has_flashinfer_comm

    import flashinfer
    import flashinfer.comm as fc
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.comm import gen_trtllm_comm_module

    cap = current_platform.get_device_capability()
    print(f"flashinfer {flashinfer.__version__} ({os.path.dirname(flashinfer.__file__)}); vLLM has_flashinfer "
          f"{has_flashinfer()}, has_flashinfer_comm {has_flashinfer_comm()}, allreduce_fusion "
          f"{hasattr(fc, 'allreduce_fusion')}; VLLM_FLASHINFER_ALLREDUCE_BACKEND "
          f"{envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND}; "
          f"capability {cap}; GPUs {torch.cuda.device_count()}", flush=True)
    if not has_flashinfer() or envs.VLLM_FLASHINFER_ALLREDUCE_BACKEND != "trtllm":
        print("FAILED: vLLM would not fuse (has_flashinfer: FlashInfer importable and nvcc on PATH), or would use "
              "another backend")
        return 9
    t = time.time()
    spec = gen_trtllm_comm_module()
    how = f"prebuilt ({spec.aot_path})" if spec.is_aot else f"built by FlashInfer's JIT ({jit_env.FLASHINFER_JIT_DIR})"
    try:
        spec.build_and_load()  # what the workspace's first use does in every rank
    except Exception as e:  # noqa: BLE001 - a prebuilt module that does not load here is compiled instead
        if not spec.is_aot:
            raise
        print(f"the prebuilt {spec.aot_path} does not load ({type(e).__name__}: {e}): moved aside, compiling it")
        spec.aot_path.rename(spec.aot_path.with_name(spec.aot_path.name + ".bad"))
        how = f"built by FlashInfer's JIT ({jit_env.FLASHINFER_JIT_DIR}; the prebuilt one did not load)"
        spec.build_and_load()
    print(f"trtllm_comm module ready in {time.time() - t:.0f} s: {how}", flush=True)
    if argv[:1] == ["--jit-only"]:
        open(argv[1], "w").close()
        return 0
    if torch.cuda.device_count() < 2:
        print("one GPU: no fused all-reduce check")
        return 0
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(rank_main, args=(2, port, q), nprocs=2, join=True, start_method="spawn")
    res = q.get()
    ok = True
    for n, res_err, res_max, norm_err, norm_max in res["rows"]:
        # bf16 outputs against float32: each within 2 bf16 ulps of the largest magnitude (2 x 2^-7 of it)
        good = res_err <= 2 ** -6 * res_max and norm_err <= 2 ** -6 * norm_max
        ok &= good
        print(f"  fused all-reduce + add + RMSNorm, N {n:5d}: residual max err {res_err:.4f} (max {res_max:.2f}), "
              f"norm max err {norm_err:.4f} (max {norm_max:.2f}) {'ok' if good else 'MISMATCH'}")
    print(f"workspace backend {res['backend']}; {'PASSED' if ok else 'FAILED'} in {time.time() - t0:.0f} s")
    return 0 if ok else 10


if __name__ == "__main__":
    code = 1
    try:
        code = main(sys.argv[1:])
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    os._exit(code)
