"""The OpenAI-server processes of the A/B suite: Server (one process), Pool (by name, state file).

Servers (each its own process group, all alive together so trials of different servers interleave):
  stock      VLLM_PLUGINS=none, no steer block
  disabled   VLLM_PLUGINS=steer, no steer block
  steer      VLLM_PLUGINS=steer, --additional-config '{"steer": {"max_configs": 272}}'
  hotwire    the peer plugin hotwire-vllm (--peer-wheel, wheel_site.py): VLLM_PLUGINS=hotwire, no steer
             block, HOTWIRE_VECTORS=<workdir>/hotwire_vectors (the 16 site vectors, site_vectors.py,
             written before it starts), HOTWIRE_SLOTS=32; CUDA only (its op is a Triton kernel), skipped
             on the CPU launcher
  steer_one  steering on with one site (post_mlp.0: one steered norm), every patch active: an ablation that
             separates the 64 steered norms in the graph from everything else steering on brings
  steer_rows4, steer_mlp   ablations: every site with 4 table rows; post_mlp sites only (32 norms), 272 rows
  sae, sae_full   steer with an SAE at 4 layers (abkit/sae_files.py): clampable features only / whole SAE
  sae_serial      sae with the clamp walk one program per token (VLLM_STEER_SAE_SPLIT_MAX=1): the split's A/B
  stock_multi, steer_multi   stock and steer behind ``--api-server-count`` front-end processes
             (``vllm serve``; --api-servers N): a front end that prepares requests in parallel
All but the wheel server share one VLLM_CACHE_ROOT (stock and disabled have the same compile key);
hotwire compiles into ``<cache root>-hotwire`` so that no artifact crosses plugin builds. A wheel
server whose option is not given is unavailable (its arms are skipped with a log line).
``--keep-servers`` leaves them running and writes STATE_FILE; ``--reuse-servers`` adopts them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .common import ROOT, log
from .model_dir import SHAPES
from .site_vectors import HOTWIRE_DIR, HOTWIRE_SLOTS, write_hotwire_vectors
from .wheel_site import dist_version, install_wheel

STEER_BLOCK = {"steer": {"max_configs": 272}}
STEER_ONE_BLOCK = {"steer": {"max_configs": 272, "hooks": ["post_mlp"], "layers": [0]}}
STEER_SERVERS = {"steer": STEER_BLOCK, "steer_multi": STEER_BLOCK,
                 "steer_one": STEER_ONE_BLOCK, "steer_rows4": {"steer": {"max_configs": 4}},
                 "steer_mlp": {"steer": {"max_configs": 272, "hooks": ["post_mlp"]}},
                 "steer_cond": {"steer": {"max_configs": 272, "conditions": True}}}
PORT_OFFSETS = {"stock": 0, "disabled": 1, "steer": 2, "stock_multi": 5, "steer_multi": 6,
                "sae": 7, "sae_full": 8, "steer_one": 9, "steer_rows4": 10, "steer_mlp": 11, "hotwire": 12,
                "sae_serial": 13, "steer_cond": 14}
# steer + an SAE at 4 layers (abkit.sae_files); full: reconstruct; serial: the clamp walk one program per token
SAE_SERVERS = {"sae": False, "sae_full": True, "sae_serial": False}
SERVER_ENV = {"sae_serial": {"VLLM_STEER_SAE_SPLIT_MAX": "1"}}
PEER_SERVER = "hotwire"


@dataclass(frozen=True)
class WheelServer:
    """A server that runs a plugin from its own wheel (wheel_site.py)."""
    option: str  # the args attribute holding the wheel's path
    flag: str  # its command-line flag
    what: str  # what the wheel is (log lines)
    site: str  # the site folder under the workdir
    dist: str  # the dist-info name (the installed version)
    plugins: str  # VLLM_PLUGINS of the server
    cache_suffix: str  # VLLM_CACHE_ROOT = <cache root><suffix>
    cuda_only: bool = False


WHEEL_SERVERS = {
    PEER_SERVER: WheelServer("peer_wheel", "--peer-wheel", "the peer plugin's hotwire_vllm-*.whl", "hotwire_site",
                             "hotwire_vllm", "hotwire", "-hotwire", cuda_only=True),
}
MULTI_SUFFIX = "_multi"  # servers (and their arms) with several API server processes
STATE_FILE = Path(tempfile.gettempdir()) / "vllm_steer_ab_servers.json"


class Server:
    def __init__(self, name: str, port: int, args, model_dir: Path, workdir: Path):
        self.name, self.port, self.args, self.model_dir = name, port, args, model_dir
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "logs" / f"{name}.log"
        self.prof_dir = workdir / "prof" / name
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.start_s: float | None = None
        self.adopted = False
        self.pythonpath_first: Path | None = None  # wheel servers: the wheel's site folder
        self.extra_env: dict[str, str] = {}  # hotwire: HOTWIRE_VECTORS, HOTWIRE_SLOTS
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
        cmd += [
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "bench",
            "--load-format", "dummy", "--dtype", a.dtype, "--seed", "0",
            "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
            "--disable-uvicorn-access-log",
        ]
        if getattr(a, "tp", 1) > 1:
            cmd += ["--tensor-parallel-size", str(a.tp)]
        if a.launcher != "cpu":
            cmd += ["--gpu-memory-utilization", str(a.gpu_mem)]
        if a.enforce_eager:
            cmd += ["--enforce-eager"]
        if self.name in STEER_SERVERS:
            cmd += ["--additional-config", json.dumps(STEER_SERVERS[self.name])]
        elif self.name in SAE_SERVERS:
            from .sae_files import sae_block

            block = sae_block(self.log_path.parent.parent, self.model_dir, SAE_SERVERS[self.name])
            cmd += ["--additional-config", json.dumps(block)]
        if a.profile_servers:
            cmd += ["--profiler-config", json.dumps({
                "profiler": "torch", "torch_profiler_dir": str(self.prof_dir),
                "torch_profiler_with_stack": False, "ignore_frontend": True,
                "torch_profiler_dump_cuda_time_total": False,
            })]
        return cmd

    def env(self) -> dict:
        e = dict(os.environ)
        wheel = WHEEL_SERVERS.get(self.name)
        e["VLLM_PLUGINS"] = "none" if self.name.startswith("stock") else wheel.plugins if wheel else "steer"
        e["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        e["VLLM_CACHE_ROOT"] = self.args.cache_root + (wheel.cache_suffix if wheel else "")
        e.update(self.extra_env)
        e["TOKENIZERS_PARALLELISM"] = "false"
        e["HF_HUB_OFFLINE"] = "1"
        e["PYTHONUNBUFFERED"] = "1"
        if self.pythonpath_first is not None:
            e["PYTHONPATH"] = os.pathsep.join([str(self.pythonpath_first)]
                                              + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
        if self.args.launcher == "cpu":
            e.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            e.setdefault("VLLM_HOST_IP", "127.0.0.1")
        return e

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=3) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001
            return False

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.prof_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        env = self.env()
        extra = f" (PYTHONPATH={env['PYTHONPATH']})" if self.pythonpath_first is not None else ""
        extra += "".join(f" ({k}={v})" for k, v in self.extra_env.items())
        log(f"server {self.name}: starting on :{self.port}{extra}: {' '.join(cmd)}")
        self._t_start = time.time()
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT))
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        t_end = time.time() + timeout
        while time.time() < t_end:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n{self.tail(60)}")
            if self.proc is None and not self.alive():
                raise RuntimeError(f"server {self.name} (adopted) exited:\n{self.tail(60)}")
            if self.healthy():
                self.start_s = round(time.time() - self._t_start, 1)
                log(f"server {self.name}: ready after {self.start_s} s")
                return
            time.sleep(1.0)
        raise RuntimeError(f"server {self.name} not ready after {timeout} s:\n{self.tail(60)}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self.proc is not None:
            return self.proc.poll() is None
        try:
            os.kill(self.pid, 0)
            return True
        except OSError:
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
            while time.time() < t_end:
                if self.proc is not None:
                    if self.proc.poll() is not None:
                        break
                elif not self.alive():
                    break
                time.sleep(0.5)
            else:
                continue
            break
        # the process group may still hold the engine core for a moment
        for _ in range(20):
            try:
                os.killpg(self.pid, 0)
            except OSError:
                return
            time.sleep(0.5)


def server_unavailable(name: str, args) -> str | None:
    """Why server ``name`` cannot run in this invocation (None: it can)."""
    if name not in PORT_OFFSETS:
        return f"unknown server {name!r} (known: {', '.join(PORT_OFFSETS)})"
    wheel = WHEEL_SERVERS.get(name)
    if wheel and not getattr(args, wheel.option, None):
        return f"{name} needs {wheel.flag} PATH ({wheel.what})"
    if wheel and wheel.cuda_only and getattr(args, "launcher", "gpu") == "cpu":
        return f"{name} runs on CUDA only (not on the CPU launcher)"
    return None


class Pool:
    """Servers by name, started lazily (one after another: memory profiling must not overlap)."""

    def __init__(self, args, model_dir: Path, workdir: Path):
        self.args, self.model_dir, self.workdir = args, model_dir, workdir
        self.servers: dict[str, Server] = {}
        self.ports = {name: args.port_base + off for name, off in PORT_OFFSETS.items()}
        self.pending: dict[str, Server] = {}
        self.sites: dict[str, Path] = {}  # wheel servers: installed site folders
        self.failed: dict[str, str] = {}  # servers that did not start: not tried again in this run
        if args.reuse_servers and STATE_FILE.exists():
            for name, st in json.loads(STATE_FILE.read_text()).items():
                s = Server(name, st["port"], args, model_dir, workdir)
                s.pid, s.start_s, s.adopted = st["pid"], st.get("start_s"), True
                s._t_start = st.get("t_start") or time.time()
                if s.alive() and s.healthy():
                    self.servers[name] = s
                    log(f"server {name}: adopted (pid {s.pid}, :{s.port})")
                elif s.alive():  # left while still starting: wait for it when needed
                    self.pending[name] = s
                    log(f"server {name}: adopted while starting (pid {s.pid}, :{s.port})")

    def wheel_site(self, name: str) -> Path:
        """The site folder of wheel server ``name``'s wheel (installed on first use)."""
        if name not in self.sites:
            w = WHEEL_SERVERS[name]
            self.sites[name] = install_wheel(getattr(self.args, w.option), self.workdir / w.site, w.flag)
        return self.sites[name]

    def wheel_versions(self) -> dict[str, str | None]:
        """Installed version per wheel server whose wheel was given."""
        return {name: dist_version(self.workdir / w.site, w.dist) for name, w in WHEEL_SERVERS.items()
                if getattr(self.args, w.option, None)}

    def prepare(self, s: Server) -> None:
        """What a server needs before it starts: its wheel's site folder; hotwire's vector files."""
        if s.name in WHEEL_SERVERS:
            s.pythonpath_first = self.wheel_site(s.name)
        s.extra_env.update(SERVER_ENV.get(s.name, {}))
        if s.name == PEER_SERVER:
            folder = write_hotwire_vectors(self.workdir / HOTWIRE_DIR, SHAPES[self.args.shape], self.args.std)
            s.extra_env.update(HOTWIRE_VECTORS=str(folder), HOTWIRE_SLOTS=str(HOTWIRE_SLOTS))

    def ensure(self, names: list[str]) -> None:
        for name in names:
            if name not in self.servers:
                if name in self.failed:
                    raise RuntimeError(f"server {name} failed earlier in this run: {self.failed[name][:1500]}")
                s = self.pending.pop(name, None)
                if s is None:
                    why = server_unavailable(name, self.args)
                    if why:
                        raise RuntimeError(why)
                    s = Server(name, self.ports[name], self.args, self.model_dir, self.workdir)
                    try:
                        self.prepare(s)
                    except Exception as e:
                        self.failed[name] = f"{type(e).__name__}: {e}"
                        raise
                    s.start()
                self.servers[name] = s
                self.save_state()  # a server still starting is adopted by the next --reuse-servers
                try:
                    s.wait_ready(self.args.start_timeout)
                except Exception as e:
                    self.failed[name] = f"{type(e).__name__}: {e}"
                    self.servers.pop(name, None)
                    s.stop()
                    self.save_state()
                    raise
                self.save_state()

    def get(self, name: str) -> Server:
        self.ensure([name])
        return self.servers[name]

    def save_state(self) -> None:
        STATE_FILE.write_text(json.dumps({n: {"pid": s.pid, "port": s.port, "start_s": s.start_s,
                                              "t_start": getattr(s, "_t_start", None)}
                                          for n, s in self.servers.items() if s.alive()}))

    def stop_all(self) -> None:
        for s in list(self.servers.values())[::-1] + list(self.pending.values()):
            s.stop()
        STATE_FILE.unlink(missing_ok=True)
