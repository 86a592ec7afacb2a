"""Where a ``norm`` strength finds its sites' typical residual norms at serve time (``core.site_norms`` has
the unit and the file forms).

Two places, looked up in this order for each site:
1. the module a request names (``steering_module: {"name", "norm"}``): the norms its file carried
   (``vllm-steer extract`` writes them into the safetensors metadata) or its registration gave
   (``site_norms``). They travel with the vectors they were measured for, so a module registered on any
   server of the same model carries its strength unit along, and they sync to every API process with
   the module (the registry's meta).
2. the server's ``steer.site_norms`` (a file ``vllm-steer calibrate`` wrote, or an extracted module file),
   read once when the front end starts: inline vectors have no module, and a module registered without
   norms falls back to it.
Why not per request: norms are a property of the model at a site, measured once; a request naming a file
would make the server read paths on a client's word.
"""

from __future__ import annotations

from typing import Any

from vllm_steer.core.config import SteerConfig, SteerConfigError
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.core.site_norms import Norms, normed, read_file
from vllm_steer.core.vectors import MODULE_FIELD, Vectors


def server_norms(cfg: SteerConfig | None, num_layers: int) -> Norms | None:
    """The norms of ``steer.site_norms`` (None without one); a SteerConfigError naming the key if unreadable."""
    path = cfg.site_norms if cfg is not None else None
    if path is None:
        return None
    try:
        return read_file(path, "steer.site_norms", num_layers)
    except OSError as e:
        raise SteerConfigError(f"additional_config.steer.site_norms: cannot read {path}: {e}") from None
    except SteeringSpecError as e:
        raise SteerConfigError(f"additional_config.{e}") from None


def normed_tiers(tiers: dict[str, Vectors], norm: float, module: Any, server: Norms | None) -> dict[str, Vectors]:
    """A module's (selected) tiers with every vector scaled to ``norm`` times its site's typical norm: the
    module's own norms first, then the server's; a site in neither is a 400 on ``steering_module.norm``."""
    own = getattr(module, "site_norms", None) or {}

    def lookup(hook: str, layer: int) -> float | None:
        found = own.get((hook, layer))
        return found if found is not None else (server or {}).get((hook, layer))

    where = f"neither in module {module.name!r}'s site_norms nor in this server's steer.site_norms"
    field = f"{MODULE_FIELD}.norm"
    return {t: {h: normed(ls, h, norm, lookup, field, where) for h, ls in vecs.items()} for t, vecs in tiers.items()}
