"""What a steered request got, in a few words a client can check (issue 42: "responses say what was applied").

``report`` turns a request's steering fields and its payload into the ``steering`` object of its response
(beside the two config keys): the named module with the version the request was prepared against and its
strength, the count of sites whose residual a vector moves, the SAEs it clamps, whether a condition gates
it, the count of sites with projections, and the capture consumers it feeds. Counts, not lists: the object
is spliced into every event of a stream. It is computed once, when the request is prepared.
"""

from __future__ import annotations

from typing import Any

from vllm_steer.core.payload import SteerPayload
from vllm_steer.core.vectors import MODULE_FIELD, SAE_FIELD


def report(fields: dict[str, Any], payload: SteerPayload, store: Any) -> dict[str, Any]:
    """The response's ``steering`` entries past ``prefill`` / ``decode`` (``store``: the module store)."""
    out: dict[str, Any] = {}
    ref = fields.get(MODULE_FIELD)
    entry = None
    if ref is not None:
        name = ref if isinstance(ref, str) else ref.get("name")
        entry = store.get(name) if isinstance(name, str) else None
        module: dict[str, Any] = {"name": name, "version": payload.module.version if payload.module is not None
                                  else getattr(entry, "version", None)}
        if isinstance(ref, dict) and ref.get("norm") is not None:
            module["norm"] = ref["norm"]
        else:
            module["scale"] = ref.get("scale", 1.0) if isinstance(ref, dict) else 1.0
        out["module"] = module
    sites = {(hook, layer) for rows in payload.configs.values() for hook, (layers, _) in rows.items()
             for layer in layers}
    if payload.module is not None and entry is not None:  # a bare reference: the workers build its rows
        sel = payload.module
        sites |= {(hook, layer) for tier in entry.tiers.values() for hook, layers in tier.items()
                  for layer in layers if (sel.hooks is None or hook in sel.hooks)
                  and (sel.layers is None or layer in sel.layers)}
    out["sites"] = len(sites)
    raw_sae = fields.get(SAE_FIELD)
    if raw_sae is not None:
        given = raw_sae if isinstance(raw_sae, list) else [raw_sae]
        names = {e.get("name") for e in given if isinstance(e, dict) and e.get("name")}
        names |= {f.get("sae") for e in given if isinstance(e, dict) for f in e.get("features") or ()
                  if isinstance(f, dict) and f.get("sae")}
        out["sae"] = sorted(names)
    if payload.condition:
        out["condition"] = True
    if payload.projections:
        out["projections"] = len({(e[0], e[1]) for entries in payload.projections.values() for e in entries})
    if payload.capture:
        out["capture"] = sorted(payload.capture)
    return out
