import cProfile, pstats, io, torch, sys
sys.argv = ["x"]
from vllm_steer.kernels.steered_rms_norm.op import register
from vllm_steer.kernels.steered_rms_norm.triton import steered_norm_triton
register()
op = torch.ops.vllm_steer.steered_norm
n, d, R = 8192, 4096, 64
dev, dtype = "cuda", torch.bfloat16
x, r = torch.randn(n, d, device=dev, dtype=dtype), torch.randn(n, d, device=dev, dtype=dtype)
w = torch.randn(d, device=dev, dtype=dtype)
ta, tb = torch.zeros(R, d, device=dev, dtype=dtype), torch.zeros(R, d, device=dev, dtype=dtype)
off = torch.zeros(1, dtype=torch.uint8, device=dev)
index = torch.zeros(n, dtype=torch.int32, device=dev)
cases = {"op_idle": lambda: op(x, r, w, 1e-5, 0.0, index, [ta, off], [tb, off], [], [], 0, 0, [], None, None, None, None, [], [], []),
         "triton_wrapper_idle": lambda: steered_norm_triton(x, r, w, 1e-5, 0.0, index, (ta, off), (tb, off))}
for name, fn in cases.items():
    for _ in range(50): fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(2000): fn()
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print("#####", name); print(s.getvalue()[:6000])
