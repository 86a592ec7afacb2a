"""What a compiled graph's extra tensor inputs cost per call on the host (issue 40): a synthetic of the steered
model's shape, on the CPU.

``--layers`` layers of two norms each, every norm an opaque custom op (``bench_vs::touch(x, Tensor[] bufs)``,
like ``steered_norm``: Inductor keeps it, its list crosses the schema) after a multiply by its weight. Variants,
all compiled the way vLLM compiles on the CPU (``torch.compile(fullgraph=True, dynamic=False)``, Inductor,
every guard dropped by ``guard_filter_fn``, Inductor's runtime asserts off as vLLM 0.26 has them), each with
its own code object:

- ``k0``: no extra inputs (each op gets an empty list);
- ``kN``: N buffers spread over the norms (views of one table per kind, as ``runtime.tables.layer_views``), N
  graph inputs;
- ``kN-one``: the same N list entries, but every norm's entries are one shared buffer: 1 graph input, so the
  difference to ``kN`` is what the graph inputs themselves cost (Dynamo's pregraph bytecode, the AOT wrapper,
  Inductor's ``call``), not the op's longer lists.

Timed per call (``perf_counter_ns`` around batches of calls; the variants interleaved, rotated each round),
and Dynamo's pregraph bytecode per call (``torch._dynamo.utils.record_pregraph_bytecode_enter/exit``).

    python bench/compiled_inputs_synth.py [--layers 32 --ks 0,64,192 --rounds 7 --calls 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo.utils as dutils
import torch.nn as nn

PREGRAPH: list[int] = []
# vLLM 0.26 turns Inductor's runtime asserts off on torch < 2.12 (CompilationConfig; per input per call otherwise:
# ``assert_size_stride`` on each graph input was most of the inputs' cost here with them on)
INDUCTOR = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


@torch._disable_dynamo
def _enter():
    return time.perf_counter_ns()


@torch._disable_dynamo
def _exit(t0):
    PREGRAPH.append(time.perf_counter_ns() - t0)


dutils.record_pregraph_bytecode_enter = _enter
dutils.record_pregraph_bytecode_exit = _exit

LIB = torch.library.Library("bench_vs", "DEF")
LIB.define("touch(Tensor x, Tensor[] bufs) -> Tensor")
LIB.impl("touch", lambda x, bufs: x.clone(), "CompositeExplicitAutograd")
LIB.impl("touch", lambda x, bufs: torch.empty_like(x), "Meta")


class Norm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d), requires_grad=False)
        self.n_bufs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.bench_vs.touch(x * self.weight, [getattr(self, f"vs_{i}") for i in range(self.n_bufs)])


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.input_layernorm = Norm(d)
        self.post_attention_layernorm = Norm(d)


def model(layers: int, d: int, k: int, one: bool) -> nn.Module:
    """A fresh class (its own forward code object, so no variant's compiled code is tried for another)."""
    ns: dict = {}
    exec(f"def forward_{k}_{int(one)}(self, x):\n"
         "    for layer in self.layers:\n"
         "        x = layer.input_layernorm(x)\n"
         "        x = layer.post_attention_layernorm(x)\n"
         "    return x\n", ns)
    cls = type(f"M{k}{'one' if one else ''}", (nn.Module,), {"forward": ns[f"forward_{k}_{int(one)}"]})
    m = cls()
    m.layers = nn.ModuleList(Layer(d) for _ in range(layers))
    norms = [n for layer in m.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    per = k // len(norms)
    table = torch.zeros(8, len(norms), per or 1, d)  # [R, L, kinds, D]: a view per (norm, kind)
    flags = torch.zeros(len(norms), per or 1, 16, dtype=torch.uint8)
    shared = torch.zeros(8, d)
    for j, norm in enumerate(norms):
        norm.n_bufs = per
        for i in range(per):
            buf = shared if one else (table[:, j, i] if i % 2 == 0 else flags[j, i, :1])
            norm.register_buffer(f"vs_{i}", buf, persistent=False)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--ks", default="0,64,192")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    torch.set_num_threads(1)
    variants = {}
    for k in map(int, a.ks.split(",")):
        for one in ((False,) if k == 0 else (False, True)):
            m = model(a.layers, a.hidden, k, one)
            fn = torch.compile(m, fullgraph=True, dynamic=False, backend="inductor",
                               options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe, **INDUCTOR})
            variants[f"k{k}{'-one' if one else ''}"] = fn
    x = torch.randn(a.tokens, a.hidden)
    with torch.no_grad():
        for fn in variants.values():
            for _ in range(20):
                fn(x)
        names = list(variants)
        per_call: dict[str, list[float]] = {n: [] for n in names}
        pregraph: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds):
            for n in names[r % len(names):] + names[: r % len(names)]:
                fn = variants[n]
                PREGRAPH.clear()
                t0 = time.perf_counter_ns()
                for _ in range(a.calls):
                    fn(x)
                per_call[n].append((time.perf_counter_ns() - t0) / a.calls / 1000)
                pregraph[n].append(statistics.median(PREGRAPH) / 1000)
    base = statistics.median(per_call["k0"])
    print(f"layers {a.layers}, hidden {a.hidden}, tokens {a.tokens}, {a.rounds} rounds x {a.calls} calls; "
          "median per call (µs), min-max over rounds")
    for n in names:
        c, p = per_call[n], pregraph[n]
        print(f"{n:>9}: call {statistics.median(c):8.1f} ({min(c):.1f}-{max(c):.1f})  vs k0 "
              f"{statistics.median(c) - base:+7.1f}   pregraph {statistics.median(p):6.1f} ({min(p):.1f}-{max(p):.1f})")


if __name__ == "__main__":
    main()
