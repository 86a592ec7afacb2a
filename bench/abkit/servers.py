"""The A/B suite's OpenAI servers (Server; Pool: by name, state file), the files they read (the model directory
of a shape, weights --load-format dummy; the peer plugin's wheel; the SAE; the hotwire vectors), the log clock.
Each server is its own process group; all stay alive together so trials of different servers interleave:
  stock / disabled   VLLM_PLUGINS=none / steer, no steer block;   steer and its ablations: STEER_SERVERS
  hotwire    the peer plugin hotwire-vllm from --peer-wheel (its own site folder and VLLM_CACHE_ROOT); CUDA only
  sae / sae_full / sae_serial / sae_topk   an SAE at 4 layers (SAE_SERVERS);   transcoder   a transcoder at each of them;   *_multi   ``--api-server-count`` front ends
  steer_capture_fs   the activations and filesystem consumers (files under <workdir>/capture_fs; fs_nosync, one
             without fsync, under <workdir>/capture_fs_nosync; a pool for a whole prefill step of every layer);
             steer_capture_fs_pre the same as before s37 (capture planned before every forward, its notifier and
             reader never waiting for the next launch), steer_capture_fs_nogate only those two never waiting;
             extract_hs   stock vLLM with its own extract_hidden_states
             speculative method + ExampleHiddenStatesConnector (files under <workdir>/extract_hs)
  stock_nofuse   stock with vLLM's all-reduce + RMSNorm fusion off (pass_config.fuse_allreduce_rms): at TP >= 2
             with FlashInfer (the arfuse steps) stock runs each norm fused with the all-reduce before it; a steered norm
             never is (runtime/allreduce_fusion.py)
--keep-servers leaves them running and writes STATE_FILE; --reuse-servers adopts them. Every server runs with
SAFE_ENV: FlashInfer's all-reduce on its IPC backend (trtllm), never the NVSwitch-multicast one (mnnvl, vLLM 0.26's
default), and multicast off in NCCL, PyTorch and NVSHMEM: the lent machines forbid multicast (KINDS.md)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib.metadata import distributions
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository root
T0 = time.time()  # the suite's clock: log lines and the --deadline-s budget count from here
SHAPES = {  # Llama-3-8B (GQA 8 kv heads); Llama-3.2-1B-like; CPU dry runs (vLLM CPU attention: head_dim >= 32)
    "8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256),
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=128256),
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=2048),
}
STEER_BLOCK = {"steer": {"max_configs": 272}}
PROJ_BLOCK = {"steer": {"max_configs": 272, "max_projections": 1}}  # one direction per site and row
STEER_SERVERS = {"steer": STEER_BLOCK, "steer_multi": STEER_BLOCK,
                 # ablations: one steered norm (every patch on); every site with 4 table rows; post_mlp sites only
                 "steer_one": {"steer": {"max_configs": 272, "hooks": ["post_mlp"], "layers": [0]}},
                 "steer_rows4": {"steer": {"max_configs": 4}},
                 "steer_mlp": {"steer": {"max_configs": 272, "hooks": ["post_mlp"]}},
                 "steer_cond": {"steer": {"max_configs": 272, "conditions": True}},  # conditional steering
                 # directional projections: one direction per site and row (steer.max_projections)
                 "steer_proj": PROJ_BLOCK,
                 # capture: the activations driver consumer enabled (a capture op before every steered norm)
                 "steer_capture": {"steer": {"max_configs": 272, "capture": ["activations"]}},
                 # issue 38's late kernel path (SERVER_ENV: VLLM_STEER_NORM_EARLY=0): steer and steer_proj without
                 # EARLY, the default's every slot's loads up front
                 "steer_late": STEER_BLOCK, "steer_proj_late": PROJ_BLOCK,
                 # issue 43's FP8 give-back off (SERVER_ENV: VLLM_STEER_FP8_NORM_QUANT=0, runtime/fp8_fusion.py):
                 # steer (whose norms feeding an FP8 linear write its FP8 input, the default for a quantized model)
                 # with the norm's quant left a kernel of its own, what steer was before s34
                 "steer_fp8u": STEER_BLOCK,
                 # issue 40's give-back C (SERVER_ENV: VLLM_STEER_AR_NORM=1, runtime/allreduce_fusion.py): at TP >= 2
                 # the TP all-reduce inside each plain steered norm's launch
                 "steer_arnorm": STEER_BLOCK,
                 # steer and steer_capture with every steered norm a programmatic dependent launch (SERVER_ENV:
                 # VLLM_STEER_NORM_PDL=1, kernels/steered_rms_norm: its start-up overlaps the kernel before it, as
                 # FlashInfer's fused all-reduce + norm does for stock at TP >= 2)
                 "steer_pdl": STEER_BLOCK}
STEER_SERVERS["steer_capture_pdl"] = STEER_SERVERS["steer_capture"]
PORT_OFFSETS = {"stock": 0, "disabled": 1, "steer": 2, "stock_multi": 5, "steer_multi": 6,
                "sae": 7, "sae_full": 8, "steer_one": 9, "steer_rows4": 10, "steer_mlp": 11, "hotwire": 12,
                "sae_serial": 13, "steer_cond": 14, "steer_capture": 15, "steer_capture_fs": 16, "extract_hs": 17,
                "steer_proj": 18, "transcoder": 19, "sae_topk": 20, "steer_late": 21, "steer_proj_late": 22,
                "steer_fp8u": 24, "stock_nofuse": 25, "steer_arnorm": 26, "steer_capture_fs_pre": 27,
                "steer_capture_fs_nogate": 28, "steer_pdl": 29, "steer_capture_pdl": 30}
CAPTURE_FS_SERVER, EXTRACT_SERVER = "steer_capture_fs", "extract_hs"
# steer_capture_fs as before s37: every capture plan made before the forward (VLLM_STEER_CAPTURE_IN_FORWARD=0), the
# notifier and reader never waiting for the next launch (VLLM_STEER_CAPTURE_GATE=0); _nogate: only those never waiting
CAPTURE_FS_PRE, CAPTURE_FS_NOGATE = "steer_capture_fs_pre", "steer_capture_fs_nogate"
CAPTURE_FS_DIR, EXTRACT_DIR = "capture_fs", "extract_hs"  # under the workdir: the files the capture arms write
CAPTURE_FS_NOSYNC_DIR = "capture_fs_nosync"  # the filesystem instance without fsync (fs_nosync)
CAPTURE_FS_ROWS = 131072  # a 4096-token prefill step at 32 sites (1 GiB at 8b bf16): the heavy arm drops nothing
# steer + an SAE at 4 layers; full: the whole SAE kept (reconstruct); serial: the clamp walk one program per token;
# topk: a TopK SAE (k = TOPK_K, issue 39's TopK arm), served by the full-pack kernels
TOPK_K = 64
SAE_SERVERS = {"sae": {}, "sae_full": {"reconstruct": True}, "sae_serial": {}, "sae_topk": {"topk": TOPK_K}}
TC_SERVER, TC_PREFIX = "transcoder", "ab_tc_"  # steer + a transcoder at each of the 4 SAE layers (sae-lens files)
SERVER_ENV = {"sae_serial": {"VLLM_STEER_SAE_SPLIT_MAX": "1"}, "steer_late": {"VLLM_STEER_NORM_EARLY": "0"},
              "steer_proj_late": {"VLLM_STEER_NORM_EARLY": "0"},
              "steer_fp8u": {"VLLM_STEER_FP8_NORM_QUANT": "0"}, "steer_arnorm": {"VLLM_STEER_AR_NORM": "1"},
              "steer_pdl": {"VLLM_STEER_NORM_PDL": "1"}, "steer_capture_pdl": {"VLLM_STEER_NORM_PDL": "1"},
              CAPTURE_FS_PRE: {"VLLM_STEER_CAPTURE_IN_FORWARD": "0", "VLLM_STEER_CAPTURE_GATE": "0"},
              CAPTURE_FS_NOGATE: {"VLLM_STEER_CAPTURE_GATE": "0"},
              "sae": {"VLLM_STEER_SAE_TILED": "1"}}  # the tiled prefill clamps (off by default: sae_serial is the A/B)
# stock with vLLM's all-reduce + RMSNorm fusion off (issue 40): the arfuse A/B's unfused stock, beside the fused default
NOFUSE_SERVER, NOFUSE_CONFIG = "stock_nofuse", {"pass_config": {"fuse_allreduce_rms": False}}
# every server, whatever the caller's environment: vLLM 0.26 picks FlashInfer's mnnvl all-reduce (NVSwitch multicast)
# by default once FlashInfer is importable; multicast can take a lent host's GPUs out of service for a day
SAFE_ENV = {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PEER_SERVER = "hotwire"  # runs the plugin of --peer-wheel from its own site folder
PEER_SITE, PEER_DIST = "hotwire_site", "hotwire_vllm"
MULTI_SUFFIX = "_multi"  # servers (and their arms) with several API server processes
STATE_FILE = Path(tempfile.gettempdir()) / "vllm_steer_ab_servers.json"
# the single-site work: post_mlp of --site-layer, N_SITE vectors rng(SITE_SEED) normal x --std; hotwire reads
# them as <workdir>/HOTWIRE_DIR/v{i}.pt; its slot bank holds one slot per distinct (id, layer, scale)
N_SITE, SITE_SEED, HOTWIRE_DIR, HOTWIRE_SLOTS = 16, 31, "hotwire_vectors", 32
# the SAE of the sae* servers: one random SAE per site at 4 layers, CLAMPABLE features, CLAMPED per request
SAE_NAME, D_SAE, CLAMPABLE, CLAMPED = "ab_sae", 16384, 256, 64
SAE_FEATURES = list(range(0, D_SAE, D_SAE // CLAMPABLE))[:CLAMPABLE]


# --quantization fp8_block: the config declares block-FP8 weights as DeepSeek's / Qwen3's FP8 checkpoints do (128 x 128
# weight blocks, activations quantized per token and group of 128 at run time; the dummy weights are fp8 with their
# scales), and the servers get --quantization fp8
BLOCK_FP8 = "fp8_block"
BLOCK_FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def write_model_dir(path: Path, shape: dict, dtype: str, block_fp8: bool = False) -> Path:
    """config.json (LlamaForCausalLM; ``block_fp8``: with BLOCK_FP8_CONFIG) + a word-level tokenizer covering the
    whole vocab (offline)."""
    if (path / ".complete").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab_n = shape["vocab"]
    bos, eos = vocab_n - 2, vocab_n - 1  # the last two ids
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"], "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
        "head_dim": shape["head_dim"], "vocab_size": vocab_n, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": bos, "eos_token_id": eos,
        "torch_dtype": dtype,
    } | ({"quantization_config": BLOCK_FP8_CONFIG} if block_fp8 else {})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(bos)} | {"<s>": bos, "</s>": eos}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="t0",
                            pad_token="</s>", model_max_length=8192).save_pretrained(path)
    (path / ".complete").touch()
    return path


def debug_logging_config(path: Path, debug_loggers: list[str]) -> Path:
    """vLLM's default logging config (plain formatter) with ``debug_loggers`` at DEBUG and every other logger as
    vLLM logs it, written to ``path`` for VLLM_LOGGING_CONFIG_PATH: a pass's once-per-compile debug lines (the
    arfuse steps: how many all-reduce + norm patterns vLLM's fusion pass replaced) without a whole DEBUG log."""
    import copy

    from vllm.logger import DEFAULT_LOGGING_CONFIG

    cfg = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    handler = cfg["handlers"]["vllm"]
    handler.update(level="DEBUG", formatter="vllm")  # the "vllm" logger's own level keeps the rest at INFO
    for name in debug_loggers:  # children of "vllm": their records reach its handler whatever its logger's level
        cfg["loggers"][name] = {"level": "DEBUG"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))
    return path


def log(*a) -> None:
    print(f"[ab {time.time() - T0:7.1f}s]", *a, flush=True)


def install_wheel(wheel: str | Path, site: Path) -> Path:
    """pip install --target ``site`` (no deps, no index) the --peer-wheel unless that exact wheel is there."""
    wheel = Path(wheel)
    if not wheel.is_file():
        raise FileNotFoundError(f"--peer-wheel {wheel}: no such file")
    marker = site / ".installed_from.json"
    st = wheel.stat()
    want = {"wheel": str(wheel.resolve()), "size": st.st_size, "mtime": int(st.st_mtime)}
    with contextlib.suppress(OSError, ValueError):
        if json.loads(marker.read_text()) == want:
            return site
    shutil.rmtree(site, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
           "--target", str(site), str(wheel)]
    log(f"--peer-wheel: {' '.join(cmd)}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"installing {wheel} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    marker.write_text(json.dumps(want))
    log(f"--peer-wheel: {wheel.name} installed in {site}")
    return site


def site_layer(requested: int, shape: dict) -> int:
    """--site-layer clamped to the shape's layers (the tiny CPU shape has 2)."""
    return max(0, min(int(requested), shape["layers"] - 1))


def site_vectors(shape: dict, std: float, n: int = N_SITE):
    return np.random.default_rng(SITE_SEED).standard_normal((n, shape["hidden"]), dtype=np.float32) * np.float32(std)


def sae_layers(num_layers: int) -> list[int]:  # the (up to) 4 SAE sites' layers, distinct on the tiny shape too
    return sorted({num_layers * i // 4 + num_layers // 8 for i in range(4)})


def capture_fs_block(workdir: Path) -> dict:
    """The steer block of steer_capture_fs: activations (driver) and filesystem (worker, no global spec); the API
    process's event loop watched at 0.25 s (`loop_stall_warn_s`: s40's files arm stalled ~0.5 s once, unexplained)."""
    fs = {"name": "filesystem", "params": {"root": str(workdir / CAPTURE_FS_DIR), "threads": 4}}
    nosync = {"name": "filesystem", "instance": "fs_nosync",
              "params": {"root": str(workdir / CAPTURE_FS_NOSYNC_DIR), "threads": 4, "fsync": False}}
    return {"steer": {"max_configs": 272, "capture": ["activations", fs, nosync], "capture_max_rows": CAPTURE_FS_ROWS,
                      "loop_stall_warn_s": 0.25}}


def extract_hs_args(workdir: Path, num_layers: int) -> list[str]:
    """vLLM's own hidden-state extraction at the 4 sites the prefill capture arms read (post_mlp of layer
    L*(k+1)/4 - 1): its layer id i is the residual entering layer i, i.e. post_mlp of layer i - 1."""
    ids = [num_layers * (k + 1) // 4 for k in range(4)]
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(workdir / EXTRACT_DIR)}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


def sae_block(workdir: Path, model_dir: Path, spec: dict) -> dict:
    """The steer block of an sae* server (``spec``: SAE_SERVERS' entry); the SAE (manifest format, bf16 safetensors)
    is written on first use, a TopK one under its own directory."""
    import torch
    from safetensors.torch import save_file

    k = spec.get("topk", 0)
    root = workdir / (f"sae_topk{k}" if k else "sae")
    if not (root / "manifest.json").exists():
        cfg = json.loads((model_dir / "config.json").read_text())
        hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
        root.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        sites = {}
        for layer in sae_layers(layers):
            def t(*shape: int, std: float) -> torch.Tensor:
                return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * std).to(torch.bfloat16)

            name = f"post_mlp_{layer}.safetensors"
            save_file({"W_enc": t(hidden, D_SAE, std=0.02), "W_dec": t(D_SAE, hidden, std=0.02),
                       "b_enc": t(D_SAE, std=0.01), "b_dec": t(hidden, std=0.01)}, str(root / name))
            sites[f"post_mlp.{layer}"] = name
        act = {"activation": "topk", "k": k} if k else {"activation": "relu"}
        (root / "manifest.json").write_text(json.dumps({"format": "vllm-steer-sae", "version": 1, **act,
                                                       "sites": sites}))
    entry = {"path": str(root), "features": SAE_FEATURES, **({"reconstruct": True} if spec.get("reconstruct") else {})}
    return {"steer": {"max_configs": 272, "sae": {SAE_NAME: entry}}}


def transcoder_block(workdir: Path, model_dir: Path) -> dict:
    """The steer block of the transcoder server: per SAE layer L a sae-lens transcoder directory (bf16, ReLU,
    D_SAE features; it reads layer L's MLP input, writes its output), named TC_PREFIX + L, written on first use."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    rng, sae = np.random.default_rng(1), {}
    for layer in sae_layers(layers):
        root = workdir / "transcoders" / f"{TC_PREFIX}{layer}"
        if not (root / "cfg.json").exists():
            root.mkdir(parents=True, exist_ok=True)

            def t(*shape: int, std: float) -> torch.Tensor:
                return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * std).to(torch.bfloat16)

            save_file({"W_enc": t(hidden, D_SAE, std=0.02), "W_dec": t(D_SAE, hidden, std=0.02),
                       "b_enc": t(D_SAE, std=0.01), "b_dec": t(hidden, std=0.01)}, str(root / "sae_weights.safetensors"))
            (root / "cfg.json").write_text(json.dumps({
                "d_in": hidden, "d_sae": D_SAE, "d_out": hidden, "dtype": "bfloat16", "device": "cpu",
                "apply_b_dec_to_input": False, "normalize_activations": "none", "reshape_activations": "none",
                "architecture": "transcoder",
                "metadata": {"model_name": "bench", "hook_name": f"blocks.{layer}.mlp.hook_in",
                             "hook_name_out": f"blocks.{layer}.hook_mlp_out"}}))
        sae[f"{TC_PREFIX}{layer}"] = {"path": str(root), "features": SAE_FEATURES}
    return {"steer": {"max_configs": 272, "sae": sae}}


def start_waves(names: list[str], key) -> list[list[str]]:
    """Servers started together: the first of each ``key`` (its config) in the first wave, each later one of a key in
    the wave after its predecessor's (started once that one is ready: it reads the compile cache that one wrote
    instead of writing the same files beside it)."""
    waves: list[list[str]] = []
    seen: dict[str, int] = {}
    for name in names:
        k = key(name)
        i = seen[k] = seen[k] + 1 if k in seen else 0
        while len(waves) <= i:
            waves.append([])
        waves[i].append(name)
    return waves


class Server:
    def __init__(self, name: str, port: int, args, model_dir: Path, workdir: Path):
        self.name, self.port, self.args, self.model_dir = name, port, args, model_dir
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "logs" / f"{name}.log"
        self.prof_dir = workdir / "prof" / name
        self.proc: subprocess.Popen | None = None
        self.pid = self.start_s = None  # the pid (also of an adopted server), seconds to ready
        self.extra_env: dict[str, str] = {}  # hotwire: PYTHONPATH (its site folder first), HOTWIRE_*
        self._t_start = time.time()

    def command(self) -> list[str]:
        a = self.args
        if a.launcher == "cpu":
            cmd = [sys.executable, "-m", "vllm_steer.launcher", "serve", str(self.model_dir)]
        elif self.name.endswith(MULTI_SUFFIX):  # only the CLI starts several API server processes
            cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(self.model_dir),
                   "--api-server-count", str(a.api_servers)]
        else:
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "bench", "--load-format",
                "dummy", "--dtype", a.dtype, "--seed", "0", "--max-model-len", str(a.max_model_len),
                "--max-num-seqs", str(a.max_num_seqs), "--disable-uvicorn-access-log"]
        cmd += ["--tensor-parallel-size", str(a.tp)] if getattr(a, "tp", 1) > 1 else []
        quant = getattr(a, "quantization", None)
        cmd += ["--quantization", "fp8" if quant == BLOCK_FP8 else quant] if quant else []
        cmd += ["--gpu-memory-utilization", str(a.gpu_mem)] if a.launcher != "cpu" else []
        if getattr(a, "kv_cache_gb", None):
            cmd += ["--kv-cache-memory-bytes", str(int(a.kv_cache_gb * 2**30))]
        cmd += ["--enforce-eager"] if a.enforce_eager else []
        if self.name in STEER_SERVERS:
            cmd += ["--additional-config", json.dumps(STEER_SERVERS[self.name])]
        elif self.name in (CAPTURE_FS_SERVER, CAPTURE_FS_PRE, CAPTURE_FS_NOGATE):
            cmd += ["--additional-config", json.dumps(capture_fs_block(self.log_path.parents[1]))]
        elif self.name == NOFUSE_SERVER:
            cmd += ["--compilation-config", json.dumps(NOFUSE_CONFIG)]
        elif self.name == EXTRACT_SERVER:
            layers = json.loads((self.model_dir / "config.json").read_text())["num_hidden_layers"]
            cmd += extract_hs_args(self.log_path.parents[1], layers)
        elif self.name == TC_SERVER:
            cmd += ["--additional-config", json.dumps(transcoder_block(self.log_path.parents[1], self.model_dir))]
        elif self.name in SAE_SERVERS:  # the workdir holds the SAE files
            block = sae_block(self.log_path.parents[1], self.model_dir, SAE_SERVERS[self.name])
            cmd += ["--additional-config", json.dumps(block)]
        if a.profile_servers:
            cmd += ["--profiler-config", json.dumps({
                "profiler": "torch", "torch_profiler_dir": str(self.prof_dir), "torch_profiler_with_stack": False,
                "ignore_frontend": True, "torch_profiler_dump_cuda_time_total": False})]
        return cmd

    def env(self) -> dict:
        peer = self.name == PEER_SERVER
        plain = self.name.startswith("stock") or self.name == EXTRACT_SERVER
        e = {**os.environ, "VLLM_PLUGINS": "none" if plain else "hotwire" if peer else "steer",
             "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_CACHE_ROOT": self.args.cache_root + ("-hotwire" if peer else ""),
             **self.extra_env, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
             **SAFE_ENV}
        if self.args.launcher == "cpu":  # defaults the environment may override
            e = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", **e}
        return e

    def healthy(self) -> bool:
        with contextlib.suppress(Exception), urllib.request.urlopen(self.base + "/health", timeout=3) as r:
            return r.status == 200
        return False

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.prof_dir.mkdir(parents=True, exist_ok=True)
        cmd, env = self.command(), self.env()
        extra = "".join(f" ({k}={v})" for k, v in self.extra_env.items())
        log(f"server {self.name}: starting on :{self.port}{extra}: {' '.join(cmd)}")
        self._t_start = time.time()
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT))
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        t_end = time.time() + timeout
        while time.time() < t_end:
            if not self.alive():
                how = f"with {self.proc.returncode}" if self.proc is not None else "(adopted)"
                raise RuntimeError(f"server {self.name} exited {how}:\n{self.tail(60)}")
            if self.healthy():
                self.start_s = round(time.time() - self._t_start, 1)
                log(f"server {self.name}: ready after {self.start_s} s")
                return
            time.sleep(1.0)
        raise RuntimeError(f"server {self.name} not ready after {timeout} s:\n{self.tail(60)}")

    def tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def jit_compiles(self) -> list[str]:
        """Kernels vLLM's JIT monitor saw compiled after the warm-up, from the whole log (the monitor warns once a
        kernel; our kernels launched outside the forward compile at start-up, s40: none is expected)."""
        with contextlib.suppress(OSError):
            return sorted(set(re.findall(r"JIT compilation during inference: (\w+)",
                                         self.log_path.read_text(errors="replace"))))
        return []

    def alive(self) -> bool:
        if self.proc is not None:  # our child
            return self.proc.poll() is None
        with contextlib.suppress(OSError, TypeError):  # adopted (TypeError: no pid)
            os.kill(self.pid, 0)
            return True
        return False

    def stop(self) -> None:
        """SIGINT to the server's own process group (it started a new session), then escalate."""
        if not self.alive():
            return
        log(f"server {self.name}: stopping (pid {self.pid})")
        for sig, wait in ((signal.SIGINT, 40), (signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.pid, sig)
            except OSError:
                return
            t_end = time.time() + wait
            while time.time() < t_end and self.alive():
                time.sleep(0.5)
            if not self.alive():
                break
        for _ in range(20):  # the process group may still hold the engine core for a moment
            try:
                os.killpg(self.pid, 0)
            except OSError:
                return
            time.sleep(0.5)


def server_unavailable(name: str, args) -> str | None:
    """Why server ``name`` cannot run in this invocation (None: it can)."""
    if name not in PORT_OFFSETS:
        return f"unknown server {name!r} (known: {', '.join(PORT_OFFSETS)})"
    if name == PEER_SERVER and not getattr(args, "peer_wheel", None):
        return f"{name} needs --peer-wheel PATH (the peer plugin's hotwire_vllm-*.whl)"
    if name in (PEER_SERVER, EXTRACT_SERVER) and getattr(args, "launcher", "gpu") == "cpu":
        return f"{name} runs on CUDA only (not on the CPU launcher)"
    return None


class Pool:
    """Servers by name, started lazily (one after another: memory profiling must not overlap)."""

    def __init__(self, args, model_dir: Path, workdir: Path):
        self.args, self.model_dir, self.workdir = args, model_dir, workdir
        self.servers: dict[str, Server] = {}
        self.ports = {name: args.port_base + off for name, off in PORT_OFFSETS.items()}
        self.pending: dict[str, Server] = {}
        self.failed: dict[str, str] = {}  # servers that did not start: not tried again in this run
        if args.reuse_servers and STATE_FILE.exists():
            for name, st in json.loads(STATE_FILE.read_text()).items():
                s = Server(name, st["port"], args, model_dir, workdir)
                s.pid, s.start_s, s._t_start = st["pid"], st.get("start_s"), st.get("t_start") or time.time()
                if s.alive():  # one left while still starting is waited for when needed
                    ready = s.healthy()
                    (self.servers if ready else self.pending)[name] = s
                    log(f"server {name}: adopted{'' if ready else ' while starting'} (pid {s.pid}, :{s.port})")

    def wheel_versions(self) -> dict[str, str | None]:  # the installed peer plugin's version
        if not self.args.peer_wheel:
            return {}
        found = distributions(path=[str(self.workdir / PEER_SITE)])
        return {PEER_SERVER: next((d.version for d in found if d.name.replace("-", "_") == PEER_DIST), None)}

    def prepare(self, s: Server) -> None:
        s.extra_env.update(SERVER_ENV.get(s.name, {}))
        if debug := [n for n in getattr(self.args, "debug_loggers", "").split(",") if n]:
            path = debug_logging_config(self.workdir / "logging_debug.json", debug)
            s.extra_env["VLLM_LOGGING_CONFIG_PATH"] = str(path)
        if s.name != PEER_SERVER:
            return
        import torch

        path = [str(install_wheel(self.args.peer_wheel, self.workdir / PEER_SITE)),
                *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        folder = self.workdir / HOTWIRE_DIR  # v{i}.pt: torch.save of site vector i (the id is the file name)
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.pt"):
            old.unlink()
        for i, v in enumerate(site_vectors(SHAPES[self.args.shape], self.args.std)):
            torch.save(torch.from_numpy(v.copy()), folder / f"v{i}.pt")
        s.extra_env.update(PYTHONPATH=os.pathsep.join(path), HOTWIRE_VECTORS=str(folder),
                           HOTWIRE_SLOTS=str(HOTWIRE_SLOTS))

    def ensure(self, names: list[str]) -> None:
        """The servers ``names`` started (or adopted) and ready, one after another; with ``--kv-cache-gb`` together
        (``start_waves``)."""
        missing = [n for n in names if n not in self.servers]
        if getattr(self.args, "kv_cache_gb", None) and len(missing) > 1:
            errors = []  # one that fails does not stop the others: the first error is raised once all were waited for
            for wave in start_waves(missing, self.config_key):
                started = []
                for name in wave:
                    try:
                        self._start(name)
                        started.append(name)
                    except Exception as e:  # noqa: BLE001
                        errors.append(e)
                for name in started:
                    try:
                        self._ready(name)
                    except Exception as e:  # noqa: BLE001
                        errors.append(e)
            if errors:
                raise errors[0]
            return
        for name in missing:
            self._start(name)
            self._ready(name)

    def config_key(self, name: str) -> str:
        """What decides a server's compile cache: its command without port and profiler folder, and its env's
        ``VLLM_PLUGINS`` (two servers with one key compile the same graphs)."""
        s = Server(name, 0, self.args, self.model_dir, self.workdir)
        cmd = s.command()
        for flag in ("--port", "--profiler-config"):
            if flag in cmd:
                i = cmd.index(flag)
                del cmd[i : i + 2]
        return json.dumps([cmd, s.env()["VLLM_PLUGINS"]])

    def _start(self, name: str) -> None:
        if name in self.failed:
            raise RuntimeError(f"server {name} failed earlier in this run: {self.failed[name][:1500]}")
        s = self.pending.pop(name, None)
        if s is None and (why := server_unavailable(name, self.args)):
            raise RuntimeError(why)
        try:
            if s is None:
                s = Server(name, self.ports[name], self.args, self.model_dir, self.workdir)
                self.prepare(s)
                s.start()
            self.servers[name] = s
            self.save_state()  # a server still starting is adopted by the next --reuse-servers
        except Exception as e:
            self._failed(name, s, e)
            raise

    def _ready(self, name: str) -> None:
        s = self.servers[name]
        try:
            s.wait_ready(self.args.start_timeout)
        except Exception as e:
            self._failed(name, s, e)
            raise
        self.save_state()

    def _failed(self, name: str, s: "Server | None", e: Exception) -> None:
        self.failed[name] = f"{type(e).__name__}: {e}"
        self.servers.pop(name, None)
        if s is not None:
            s.stop()
        self.save_state()

    def get(self, name: str) -> Server:
        self.ensure([name])
        return self.servers[name]

    def save_state(self) -> None:
        STATE_FILE.write_text(json.dumps({n: {"pid": s.pid, "port": s.port, "start_s": s.start_s, "t_start": s._t_start}
                                          for n, s in self.servers.items() if s.alive()}))

    def stop_all(self) -> None:
        for s in list(self.servers.values())[::-1] + list(self.pending.values()):
            s.stop()
        STATE_FILE.unlink(missing_ok=True)
