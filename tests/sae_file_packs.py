"""Full SAE packs staged from files the formats' own code wrote, the way a worker stages them
(``runtime.sae_tables.SaeTables``: at start-up, or registered into a runtime full reservation), with request rows
written through the request parser, and the formats' own encode / decode as the reference: EleutherAI sparsify's
``SparseCoder.encode`` / ``decode`` (TopK) and Gemma Scope's JumpReLU as its release publishes it (``pre = x W_enc +
b_enc``, ``f = pre * (pre > threshold)``, ``x_hat = f W_dec + b_dec``: the Gemma Scope tutorial's ``JumpReLUSAE``).
None of the reference arithmetic is ours; only the clamp kinds (set / add / scale, ``only_if_active``) are the
request's definition (docs/sae.md), written out here. Used by ``tests/gpu/test_sae_files_gpu.py`` (H200 sizes) and
``tests/interpreted/test_sae_files_interpreted.py`` (its CPU twin under Triton's interpreter)."""

from __future__ import annotations

import numpy as np
import torch

from tests.sae_oracle import sparsify_coder
from tests.sae_writers import random_sae, write_gemma_scope

SITE, SITE_NAME = ("post_mlp", 3), "post_mlp.3"
LAYERS = 4
# the rows of every case: 1 RECONSTRUCT, 2 DELTA with every clamp kind, 3 RECONSTRUCT with a clamp, 4 DELTA ablating
# one feature (scale 0); row 0 and OFF tokens are left out of the comparison (the kernels do not write them)
CLAMPS = [{"feature": 3, "kind": "set", "value": 6.0}, {"feature": 17, "kind": "scale", "value": 0.0},
          {"feature": 40, "kind": "add", "value": 2.5}, {"feature": 9, "kind": "scale", "value": 3.0,
                                                         "only_if_active": True}]
ROWS = {1: {"mode": "reconstruct"}, 2: {"clamps": CLAMPS}, 3: {"mode": "reconstruct", "clamps": CLAMPS[:1]},
        4: {"clamps": [CLAMPS[1]]}}
FEATURES = sorted({c["feature"] for c in CLAMPS})
NUM_ROWS = 6


def bf16_values(a: torch.Tensor) -> torch.Tensor:
    return a.bfloat16().float()


def sparsify_file(folder, d: int, f: int, k: int, seed: int, bias: float = 0.0):
    """A sparsify TopK SAE saved by its own ``save_to_disk`` in ``folder`` (a hookpoint folder, ``layers.3``),
    weights bf16 values (the engine stages a full pack in bf16: the reference then computes with the same SAE), std
    1/sqrt(d) (pre-activations of order 1 for a stream of order 1), ``bias`` added to the encoder's; returns the
    coder."""
    coder = sparsify_coder(d, f, k, seed=seed, scale=d ** -0.5, bf16=True, bias_shift=-bias)
    coder.save_to_disk(folder)
    return coder


def gemma_scope_file(folder, d: int, f: int, seed: int, bias: float = 0.0) -> dict[str, torch.Tensor]:
    """A Gemma Scope ``params.npz`` (JumpReLU) in ``folder``, weights bf16 values, thresholds spread over the
    pre-activations' range (about half the features active), ``bias`` added to b_enc; returns its arrays as float32
    tensors."""
    w = random_sae(d, f, "jumprelu", seed=seed)
    g = np.random.default_rng(seed + 1)
    w.w_enc[:] = g.normal(0.0, d ** -0.5, size=w.w_enc.shape)
    w.threshold[:] = g.uniform(0.0, 1.0, size=f)
    w.b_enc[:] += bias
    for a in (w.w_enc, w.w_dec):
        a[:] = bf16_values(torch.from_numpy(a)).numpy()
    write_gemma_scope(str(folder), w)
    return {k: torch.from_numpy(np.array(v)) for k, v in
            {"W_enc": w.w_enc, "b_enc": w.b_enc, "W_dec": w.w_dec, "b_dec": w.b_dec, "threshold": w.threshold}.items()}


def startup_tables(path: str, d: int, device, name: str = "sae"):
    """``path``'s SAE as a start-up ``steer.sae`` entry at SITE, ``reconstruct`` allowed: (tables, catalog)."""
    from vllm_steer.core.config import SteerConfig
    from vllm_steer.core.sae_catalog import sae_catalog
    from vllm_steer.core.sae_paths import runtime_access
    from vllm_steer.runtime.sae_tables import SaeTables

    cfg = SteerConfig.model_validate({"sae": {name: {"path": path, "site": SITE_NAME, "reconstruct": True,
                                                     "features": FEATURES}}})
    catalog = sae_catalog(cfg, d, LAYERS)
    return SaeTables(catalog, {}, {SITE}, NUM_ROWS, d, torch.device(device), runtime_access(None, 1)), catalog


def reserved_tables(root, d: int, width: int, k: int, device):
    """A runtime full reservation at SITE (``width`` features, TopK ``k`` or 0, reconstruct allowed) and a
    ``register(path)`` that checks a registration as the engine core does and stages it (``load_runtime``), then
    returns the catalog requests are parsed against."""
    from vllm_steer.core.config import SaeModuleConfig, SteerConfig
    from vllm_steer.core.sae_catalog import runtime_entry, slot_sites
    from vllm_steer.core.sae_paths import runtime_access
    from vllm_steer.runtime.sae_tables import SaeTables

    cfg = SteerConfig.model_validate({"sae_root": str(root), "sae_slots": {SITE_NAME: {
        "features": len(FEATURES), "d_sae": width, "k": k, "reconstruct": True}}})
    slots = slot_sites(cfg, LAYERS)
    tables = SaeTables({}, slots, {SITE}, NUM_ROWS, d, torch.device(device),
                       runtime_access(cfg.sae_root, cfg.max_sae_bytes))

    def register(path: str) -> dict:
        entry = runtime_entry("rt", SaeModuleConfig(path=path, site=SITE_NAME, features=FEATURES,
                                                    reconstruct=True), cfg, d, LAYERS, slots, 1)
        assert tables.load_runtime(path, None, SITE_NAME, entry.features, [SITE]) == [SITE]
        return {"rt": entry}

    return tables, register


def write_rows(tables, catalog: dict) -> None:
    """ROWS through the request parser into every row's tables (row 5 stays OFF)."""
    from vllm_steer.frontend.sae_spec import parse_sae

    (name,) = catalog
    for r, item in ROWS.items():
        tables.write_row(r, parse_sae({"name": name, **item}, catalog)[0])


def _clamped(f: torch.Tensor, clamps: list) -> torch.Tensor:
    """The request's clamps on the activations ``f`` [N, F] (docs/sae.md: set / add / scale, ``only_if_active``
    leaves a feature that is 0 alone)."""
    out = f.clone()
    for c in clamps:
        j, v = c["feature"], c["value"]
        new = {"set": torch.full_like(f[:, j], v), "add": f[:, j] + v, "scale": f[:, j] * v}[c["kind"]]
        out[:, j] = torch.where(f[:, j] != 0, new, f[:, j]) if c.get("only_if_active") else new
    return out


def expected(x: torch.Tensor, rows: torch.Tensor, encode, decode) -> torch.Tensor:
    """The stream after the site for each token of ``x`` [N, D] by the reference's ``encode`` (x -> dense f [N, F])
    and ``decode`` (f -> x_hat, b_dec included): RECONSTRUCT rows ``decode(f')``, DELTA rows ``x + decode(f') -
    decode(f)``; other tokens ``x``."""
    f = encode(x)
    out = x.clone()
    for r, item in ROWS.items():
        on = rows == r
        if not bool(on.any()):
            continue
        fr = f[on]
        fn = _clamped(fr, item.get("clamps", []))
        if item.get("mode") == "reconstruct":
            out[on] = decode(fn)
        else:
            out[on] = x[on] + decode(fn) - decode(fr)
    return out


def sparsify_reference(coder):
    """(encode, decode, pre) by sparsify's own ``SparseCoder``: ``encode`` (b_dec subtracted from the input, ReLU,
    TopK) scattered to dense activations, ``decode`` of every latent (its ``decode`` adds b_dec), and the
    pre-activations (for the tokens whose TopK is a near tie)."""
    def encode(x):
        acts, idx, _ = coder.encode(x)
        return torch.zeros(x.shape[0], coder.num_latents, device=x.device).scatter(-1, idx, acts.float())

    def decode(f):
        every = torch.arange(coder.num_latents, device=f.device).expand(f.shape[0], -1)
        return coder.decode(f, every).float()

    def pre(x):
        return torch.relu((x - coder.b_dec) @ coder.encoder.weight.T + coder.encoder.bias)

    return encode, decode, pre


def gemma_scope_reference(p: dict[str, torch.Tensor]):
    """(encode, decode, pre) of a Gemma Scope JumpReLU SAE as its release defines it (the tutorial's
    ``JumpReLUSAE``): ``pre = x W_enc + b_enc``, ``f = (pre > threshold) * relu(pre)``, ``x_hat = f W_dec + b_dec``."""
    def pre(x):
        return x @ p["W_enc"] + p["b_enc"]

    def encode(x):
        z = pre(x)
        return (z > p["threshold"]) * torch.relu(z)

    def decode(f):
        return f @ p["W_dec"] + p["b_dec"]

    return encode, decode, pre


def pick_tokens(pool: torch.Tensor, pre, w_enc: torch.Tensor, k: int, thr: torch.Tensor | None, n: int,
                shift: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``n`` tokens of ``pool`` [P, D] whose activation set no rounding of the kernels can change: each
    pre-activation's bound ``m = 2^-17 sum |s| |W_enc|`` (the stream's bf16 hi + lo split, ``s`` = x - ``shift``);
    TopK, the k-th and k+1-th more than 2 max(m) apart (or the k-th below max(m): the rest are ~0); JumpReLU, none
    within m of its threshold. The inputs are chosen, the reference decides; a wrong kernel still fails on them."""
    s = pool - shift if shift is not None else pool
    z = pre(pool)
    m = 2.0 ** -17 * (s.abs() @ w_enc.abs())
    if k:
        top = z.topk(k + 1, dim=-1).values
        big = m.amax(-1)
        clear = ((top[:, k - 1] - top[:, k]) > 2 * big) | (top[:, k - 1] < big)
    else:
        clear = ~((z - thr).abs() < m).any(-1)
    idx = torch.nonzero(clear).flatten()[:n]
    assert idx.numel() == n, f"only {idx.numel()} of {pool.shape[0]} tokens clear of a tie"
    return pool[idx].contiguous()


def kernel_stream(x: torch.Tensor, index: torch.Tensor, pack, k: int) -> torch.Tensor:
    """The stream after the site by the full kernels (``full_triton.site_edit``, what the norm adds)."""
    from vllm_steer.kernels.sae_clamp.full_triton import site_edit

    return x + site_edit(x, None, index, pack, k)


def check(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, index: torch.Tensor, tol: float) -> None:
    """Every on token (rows 1-4) within ``tol`` of the reference relative to the largest element of its stream, and
    every row 1-3 present moved the stream by more than 10 ``tol`` (a missing edit fails; row 4's ablated feature
    may be inactive)."""
    rows = index[: x.shape[0]].long()
    on = (rows >= 1) & (rows <= 4)
    assert bool(on.any())
    scale = float(want[on].abs().max())
    err = float((got[on] - want[on]).abs().max())
    assert err <= tol * scale, f"max error {err:.3g} > {tol} x {scale:.3g}"
    for r in range(1, 4):
        moved = (want[rows == r] - x[rows == r]).abs()
        assert moved.numel() == 0 or float(moved.max()) > 10 * tol * scale, f"row {r} did not move the stream"


def _index(n: int, device) -> torch.Tensor:
    """[n] int32: tokens cycling through rows 1-4 (every on row; N 1: a RECONSTRUCT token)."""
    return (torch.arange(n, device=device) % 4 + 1).to(torch.int32)


def _reference(kind: str, source, device):
    """(encode, decode, pre, W_enc [D, F], shift, thr) of the reference for a sparsify coder or Gemma Scope arrays."""
    if kind == "sparsify":
        coder = source.to(device)
        encode, decode, pre = sparsify_reference(coder)
        return encode, decode, pre, coder.encoder.weight.T, coder.b_dec, None
    p = {k: v.to(device) for k, v in source.items()}
    encode, decode, pre = gemma_scope_reference(p)
    return encode, decode, pre, p["W_enc"], None, p["threshold"]


def _write(kind: str, root, name: str, d: int, f: int, k: int, seed: int, bias: float = 0.0):
    """(path, source) of a ``kind`` SAE file of ``f`` features under ``root``."""
    if kind == "sparsify":
        folder = root / name / "layers.3"
        return str(folder), sparsify_file(folder, d, f, k, seed, bias)
    return str(root / name), gemma_scope_file(root / name, d, f, seed, bias)


@torch.no_grad()
def padded_runtime_case(root, kind: str, d: int, width: int, f: int, k: int, n: int, device, tol: float) -> None:
    """A ``kind`` SAE of ``f`` features (not a multiple of the kernels' 64-feature tiles) registered into a runtime
    full reservation of ``width`` after an SAE of the full width was registered there (none of its arrays may
    survive: the padding is zero weights, ``_PAD_BIAS`` and zero thresholds; its encoder biases are 3 above the
    small SAE's pre-activations, so a stale one enters a TopK, a stale W_enc / W_dec column moves a JumpReLU
    reconstruction), clamped and reconstructed by the kernels as the
    format's own code does for the small SAE alone."""
    tables, register = reserved_tables(root, d, width, k, device)
    big_path, _ = _write(kind, root, "big", d, width, k, seed=5, bias=3.0)
    register(big_path)
    path, source = _write(kind, root, "small", d, f, k, seed=6)
    catalog = register(path)
    write_rows(tables, catalog)
    pack = tables.packs[SITE]
    assert pack[8].shape[1] == width and tables.topk[SITE] == k
    encode, decode, pre, w_enc, shift, thr = _reference(kind, source, device)
    g = torch.Generator(device=device).manual_seed(7)
    pool = torch.randn(4 * n + 32, d, generator=g, device=device) * 2.0
    x = pick_tokens(pool, pre, w_enc, k, thr, n, shift)
    index = _index(n, device)
    want = expected(x, index.long(), encode, decode)
    check(kernel_stream(x, index, pack, k), want, x, index, tol)


@torch.no_grad()
def wide_sparsify_case(root, d: int, f: int, k: int, ns: tuple[int, ...], device, tol: float, graph: bool) -> None:
    """A sparsify TopK SAE of ``f`` features loaded at start-up from its own ``save_to_disk``: the kernels' stream
    at each N in ``ns`` against sparsify's encode / decode; ``graph``: also replayed in a CUDA graph captured with
    every row OFF, after the rows and the stream were written in place."""
    path, coder = _write("sparsify", root, "wide", d, f, k, seed=8)
    tables, catalog = startup_tables(path, d, device)
    write_rows(tables, catalog)
    pack = tables.packs[SITE]
    assert pack[8].shape[1] == f and tables.topk[SITE] == k
    encode, decode, pre, w_enc, shift, thr = _reference("sparsify", coder, device)
    g = torch.Generator(device=device).manual_seed(9)
    for n in ns:
        pool = torch.randn(4 * n + 32, d, generator=g, device=device) * 2.0
        x = pick_tokens(pool, pre, w_enc, k, thr, n, shift)
        index = _index(n, device)
        want = expected(x, index.long(), encode, decode)
        check(kernel_stream(x, index, pack, k), want, x, index, tol)
    if not graph:
        return
    n = ns[-1]
    pool = torch.randn(8 * n + 32, d, generator=g, device=device) * 2.0
    x, x2 = pick_tokens(pool, pre, w_enc, k, thr, 2 * n, shift).split(n)
    index = _index(n, device)
    static = x.clone()
    saved = pack[0].clone()
    pack[0].zero_()
    kernel_stream(static, index, pack, k)  # JIT outside the graph
    torch.cuda.synchronize()
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        out = kernel_stream(static, index, pack, k)
    pack[0].copy_(saved)
    for xs in (x, x2):
        static.copy_(xs)
        cuda_graph.replay()
        torch.cuda.synchronize()
        check(out.clone(), expected(xs, index.long(), encode, decode), xs, index, tol)
