"""Directional projections without an engine: the request fields (``frontend.projection_spec`` through the
front end: phases, keys, 400s naming the field) and the worker's row tables (``runtime.projection_tables``:
written with the row, cleared when the row is reused). The engine oracle is in tests/test_sae_engine.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.test_spec_and_hash import _frontend
from vllm_steer.core.errors import SteeringSpecError
from vllm_steer.runtime.projection_tables import ProjectionTables

D = 8
DIR = np.arange(1, D + 1, dtype=np.float32)
UNIT = DIR / np.linalg.norm(DIR.astype(np.float64))


def ablate(d=DIR) -> dict:
    return {"direction": np.asarray(d).tolist(), "mode": "ablate"}


def cap(lo=None, hi=None, d=DIR) -> dict:
    return {"direction": np.asarray(d).tolist(), "mode": "cap", **({"min": lo} if lo is not None else {}),
            **({"max": hi} if hi is not None else {})}


@pytest.fixture(scope="module")
def fe():
    return _frontend(dtype=torch.float32, layers=4, hidden=D, max_projections=2)


def _entries(payload, key):
    return [(h, l, np.frombuffer(d, np.float32).reshape(-1, D), np.frombuffer(b, np.float32).reshape(-1, 2))
            for h, l, d, b in payload.projections[key]]


def test_directions_are_normalised_and_phases_stack_base_then_own(fe):
    p, pk, dk = fe.resolve({"steering_projections": {"post_mlp": {"1": [ablate()]}},
                            "decode_steering_projections": {"post_mlp.1": [cap(-1.5)], "pre_attn.2": [cap(hi=2.0)]}})
    assert pk != dk and p.configs == {pk: {}, dk: {}}  # projections only: empty vector rows, one row per phase
    [(hook, layer, dirs, bounds)] = _entries(p, pk)
    assert (hook, layer) == ("post_mlp", 1)
    np.testing.assert_allclose(dirs, [UNIT], rtol=1e-6)
    assert bounds.tolist() == [[0.0, 0.0]]
    got = _entries(p, dk)
    assert [(h, l) for h, l, _, _ in got] == [("pre_attn", 2), ("post_mlp", 1)]  # site order
    assert got[0][3].tolist() == [[-np.inf, 2.0]]
    assert got[1][3].tolist() == [[0.0, 0.0], [-1.5, np.inf]]  # the base tier's op first


def test_projections_key_the_config_apart_from_the_same_vectors_and_from_each_other(fe):
    vec = {"steering_vectors": {"post_mlp": {"1": DIR.tolist()}}}
    _, plain, _ = fe.resolve(vec)
    p, k1, k1d = fe.resolve({**vec, "steering_projections": {"post_mlp": {"1": [ablate()]}}})
    assert k1 == k1d and k1 != plain and p.configs[k1] == fe.resolve(vec)[0].configs[plain]
    _, scaled, _ = fe.resolve({**vec, "steering_projections": {"post_mlp": {"1": [ablate(DIR * 3)]}}})
    assert scaled == k1  # the same unit direction
    _, other, _ = fe.resolve({**vec, "steering_projections": {"post_mlp": {"1": [cap(0.0, 0.0)]}}})
    assert other == k1  # a [0, 0] cap is an ablation
    _, moved, _ = fe.resolve({**vec, "steering_projections": {"post_mlp": {"1": [cap(0.0, 1.0)]}}})
    assert moved != k1


def test_projections_ride_with_sae_like_rows_under_one_key_per_phase(fe):
    p, pk, dk = fe.resolve({"prefill_steering_projections": {"post_mlp.2": [ablate()]}})
    assert dk is None and pk is not None and list(p.projections) == [pk]


@pytest.mark.parametrize("fields, field, words", [
    ({"steering_projections": [1]}, "steering_projections", "expected an object"),
    ({"steering_projections": {"mid": {"1": [ablate()]}}}, "steering_projections.mid", "unknown hook point"),
    ({"steering_projections": {"post_mlp": {"9": [ablate()]}}}, "steering_projections.post_mlp.9", "out of range"),
    ({"steering_projections": {"post_mlp": [ablate()]}}, "steering_projections.post_mlp", "expected {layer"),
    ({"steering_projections": {"post_mlp.1": []}}, "steering_projections.post_mlp.1", "non-empty list"),
    ({"steering_projections": {"post_mlp.1": [{"mode": "ablate"}]}}, "steering_projections.post_mlp.1[0].direction",
     "required"),
    ({"steering_projections": {"post_mlp.1": [{**ablate(), "mode": "erase"}]}},
     "steering_projections.post_mlp.1[0].mode", "expected one of"),
    ({"steering_projections": {"post_mlp.1": [ablate([0.0] * D)]}}, "steering_projections.post_mlp.1[0].direction",
     "non-zero"),
    ({"steering_projections": {"post_mlp.1": [ablate([1.0] * (D - 1))]}},
     "steering_projections.post_mlp.1[0].direction", "hidden size"),
    ({"steering_projections": {"post_mlp.1": [{**ablate(), "max": 1.0}]}}, "steering_projections.post_mlp.1[0].max",
     "unknown key"),
    ({"steering_projections": {"post_mlp.1": [cap()]}}, "steering_projections.post_mlp.1[0]", "needs a bound"),
    ({"steering_projections": {"post_mlp.1": [cap(2.0, 1.0)]}}, "steering_projections.post_mlp.1[0].min", "above max"),
    ({"steering_projections": {"post_mlp.1": [cap("a")]}}, "steering_projections.post_mlp.1[0].min", "finite number"),
    ({"steering_projections": {"post_mlp.1": [ablate()] * 3}}, "steering_projections.post_mlp.1",
     "over this server's steer.max_projections (2)"),
    ({"steering_projections": {"post_mlp.1": [ablate()] * 2}, "decode_steering_projections": {"post_mlp.1": [ablate()]}},
     "decode_steering_projections.post_mlp.1", "3 directions at post_mlp.1 (with steering_projections's)"),
    ({"steering_projections": {"pre_attn.0": [ablate()]}}, "steering_projections.pre_attn.0", "embeddings"),
    ({"steering_projections": {"post_mlp.1": [ablate()], "post_mlp": {"1": [ablate()]}}},
     "steering_projections.post_mlp.1", "given twice"),
])
def test_bad_projections_are_refused_naming_the_field(fe, fields, field, words):
    with pytest.raises(SteeringSpecError) as e:
        fe.resolve(fields)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_a_server_without_max_projections_refuses_the_field():
    fe = _frontend(dtype=torch.float32, layers=4, hidden=D)
    with pytest.raises(SteeringSpecError) as e:
        fe.resolve({"decode_steering_projections": {"post_mlp.1": [ablate()]}})
    assert e.value.field == "decode_steering_projections" and "steer.max_projections" in str(e.value)


def test_tables_take_a_rows_projections_and_clear_them_when_the_row_is_reused(fe):
    p, pk, _ = fe.resolve({"steering_projections": {"post_mlp.1": [ablate(), cap(1.0, 2.0)], "pre_attn.2": [ablate()]}})
    tables = ProjectionTables({("post_mlp", 1), ("pre_attn", 2), ("post_mlp", 3)}, 4, 2, D, torch.device("cpu"))
    assert tables.nbytes == 3 * (4 * 4 + 4 * 2 * D * 4 + 4 * 2 * 2 * 4)
    tables.write_row(2, p.projections[pk])
    count, dirs, bounds = tables.descs[("post_mlp", 1)]  # count[0]: the site's idle mark (no row live yet)
    assert count.tolist() == [-1, 0, 2, 0] and tables.descs[("pre_attn", 2)][0].tolist() == [-1, 0, 1, 0]
    np.testing.assert_allclose(dirs[2].numpy(), [UNIT, UNIT], rtol=1e-6)
    assert bounds[2].tolist() == [[0.0, 0.0], [1.0, 2.0]]
    q, qk, _ = fe.resolve({"steering_projections": {"post_mlp.3": [cap(hi=0.5)]}})
    tables.write_row(2, q.projections[qk])  # the row reused for another config: its old sites cleared
    assert [tables.descs[s][0].tolist() for s in (("post_mlp", 1), ("pre_attn", 2), ("post_mlp", 3))] == \
        [[-1, 0, 0, 0], [-1, 0, 0, 0], [-1, 0, 1, 0]]
    tables.write_row(2, None)
    assert tables.descs[("post_mlp", 3)][0].tolist() == [-1, 0, 0, 0]


def test_tables_may_hold_the_directions_in_the_models_dtype(fe, monkeypatch):
    """``VLLM_STEER_PROJ_DIRS=model`` (issue 38's half-bytes variant): the rows land in float32 and are cast on the
    device; the directions read back are the float32 unit vectors rounded to bf16 (the reference and the kernel read
    the same values), the bounds and counts as before, every site's view 16-byte aligned (a hidden size of 12: bf16
    rows padded to 16 elements, not 12); float32 stays the default."""
    from vllm_steer.runtime import projection_tables

    assert projection_tables.dirs_dtype(torch.bfloat16) == torch.float32  # the default: float32 whatever the model
    monkeypatch.setattr(projection_tables, "DIRS", "model")
    assert projection_tables.dirs_dtype(torch.bfloat16) == torch.bfloat16
    p, pk, _ = fe.resolve({"steering_projections": {"post_mlp.1": [ablate(), cap(1.0, 2.0)], "pre_attn.2": [ablate()]}})
    sites = {("post_mlp", 1), ("pre_attn", 2), ("post_mlp", 3)}
    tables = ProjectionTables(sites, 4, 2, D, torch.device("cpu"), torch.bfloat16)
    tables.write_row(2, p.projections[pk])
    count, dirs, bounds = tables.descs[("post_mlp", 1)]
    assert dirs.dtype == torch.bfloat16 and count.tolist() == [-1, 0, 2, 0] and bounds[2].tolist() == [[0, 0], [1, 2]]
    want = torch.from_numpy(np.stack([UNIT, UNIT])).to(torch.bfloat16)
    assert torch.equal(dirs[2], want) and not torch.equal(dirs[2].float(), torch.from_numpy(np.stack([UNIT, UNIT])))
    wide = ProjectionTables(sites, 4, 1, 12, torch.device("cpu"), torch.bfloat16)
    assert all(t.data_ptr() % 16 == 0 for desc in wide.descs.values() for t in desc)
    assert wide.descs[("pre_attn", 2)][1].stride(0) == 3 * 16


def test_a_site_is_marked_idle_while_no_live_row_projects_there(fe):
    """``count[site, 0]`` is -1 (the kernel reads no direction there) until a live row projects at the site, 0 while
    one does; rows written but not live (cached) leave the marks as they are; a site shared by two live rows stays
    live until both are released; a row rewritten while live moves its sites' counts."""
    sites = (("post_mlp", 1), ("pre_attn", 2), ("post_mlp", 3))
    tables = ProjectionTables(set(sites), 5, 2, D, torch.device("cpu"))

    def marks() -> list[int]:
        return [int(tables.descs[s][0][0]) for s in sites]

    p, pk, _ = fe.resolve({"steering_projections": {"post_mlp.1": [ablate()], "pre_attn.2": [ablate()]}})
    q, qk, _ = fe.resolve({"steering_projections": {"post_mlp.1": [cap(hi=0.5)]}})
    tables.write_row(2, p.projections[pk])
    tables.write_row(3, q.projections[qk])
    assert marks() == [-1, -1, -1]  # written, not live
    tables.set_live(2, True)
    tables.set_live(2, True)  # idempotent
    assert marks() == [0, 0, -1]
    tables.set_live(3, True)
    tables.set_live(4, True)  # a row without projections: nothing moves
    tables.set_live(2, False)
    assert marks() == [0, -1, -1]  # row 3 still holds post_mlp.1
    tables.set_live(3, False)
    assert marks() == [-1, -1, -1]
    r, rk, _ = fe.resolve({"steering_projections": {"post_mlp.3": [ablate()]}})
    tables.set_live(3, True)
    tables.write_row(3, r.projections[rk])  # rewritten while live: post_mlp.1 out, post_mlp.3 in
    assert marks() == [-1, -1, 0]
    tables.write_row(3, None)
    assert marks() == [-1, -1, -1] and tables.descs[("post_mlp", 3)][0].tolist()[3] == 0


def test_a_condition_may_gate_projections_and_keys_them_with_the_phase():
    fe = _frontend(dtype=torch.float32, layers=4, hidden=D, max_projections=2, conditions=True)
    cond = {"site": "post_mlp.1", "probe": DIR.tolist(), "applies_to": ["projections", "vectors"]}
    proj = {"steering_projections": {"post_mlp.2": [ablate()]}}
    p, pk, dk = fe.resolve({**proj, "steering_condition": cond})
    assert pk == dk and list(p.projections) == [pk] and list(p.condition) == [pk] and p.condition[pk][6] == 5
    _, ungated, _ = fe.resolve(proj)
    assert ungated != pk
    with pytest.raises(SteeringSpecError) as e:  # a projection before the probe: no gate there yet
        fe.resolve({"steering_projections": {"post_mlp.0": [ablate()]}, "steering_condition": cond})
    assert e.value.field == "steering_condition.site" and "post_mlp.0" in str(e.value)
    with pytest.raises(SteeringSpecError) as e:  # gating projections the request does not have
        fe.resolve({"steering_vectors": {"post_mlp": {"2": DIR.tolist()}},
                    "steering_condition": {**cond, "applies_to": "projections"}})
    assert e.value.field == "steering_condition" and "scales projections" in str(e.value)
    with pytest.raises(SteeringSpecError) as e:
        fe.resolve({**proj, "steering_condition": {**cond, "applies_to": ["projections", "projections"]}})
    assert e.value.field == "steering_condition.applies_to"


def test_module_files_carry_projections_and_a_module_may_be_its_vectors_as_ablations(fe):
    from safetensors.numpy import save

    from vllm_steer.frontend.module_registration import module_from_file, module_from_json

    shape = fe.module_shape
    st = save({"post_mlp.1": DIR, "decode.project.post_mlp.2": np.stack([DIR, -DIR]),
               "decode.project.post_mlp.2.bounds": np.array([[0, 0], [-np.inf, 2.0]], np.float32)})
    m = module_from_file("st", st, "m.safetensors", shape, max_projections=2)
    assert m.has_vectors and m.summary()["projections"] == {"decode_steering_projections": {"post_mlp.2": ["ablate", "cap"]}}
    assert m.projections["decode_steering_projections"]["post_mlp.2"][1] == {"direction": (-DIR).tolist(), "mode": "cap",
                                                                             "max": 2.0}
    a = module_from_json({"name": "a", "steering_vectors": {"post_mlp": {"1": DIR.tolist()}}, "as_ablation": True},
                         shape, max_projections=2)
    assert not a.has_vectors and a.summary()["projections"] == {"steering_projections": {"post_mlp.1": ["ablate"]}}
    for bad, field, words in (
            ({"project.post_mlp.2.bounds": np.zeros((1, 2), np.float32)}, "file.project.post_mlp.2.bounds", "without"),
            ({"project.post_mlp.2": DIR[None], "project.post_mlp.2.bounds": np.full((1, 2), np.nan, np.float32)},
             "file.project.post_mlp.2", "no NaN"),
            ({"project.post_mlp.2": np.zeros((1, D), np.float32)},
             "file.steering_projections.post_mlp.2[0].direction", "non-zero")):
        with pytest.raises(SteeringSpecError) as e:
            module_from_file("bad", save(bad), "m.safetensors", shape, max_projections=2)
        assert e.value.field == field and words in str(e.value), str(e.value)
    with pytest.raises(SteeringSpecError) as e:  # a server without projections
        module_from_file("st", st, "m.safetensors", shape)
    assert e.value.field.startswith("file.decode_steering_projections") and "max_projections" in str(e.value)
    with pytest.raises(SteeringSpecError) as e:
        module_from_json({"name": "a", "steering_vectors": {"post_mlp": {"1": DIR.tolist()}}, "as_ablation": True,
                          "steering_projections": {"post_mlp.1": [ablate()]}}, shape, max_projections=2)
    assert e.value.field == "as_ablation"
    # a JSON file registered with as_ablation: its vectors become ablations, as a body's flag makes them; its own
    # projection fields beside the flag are refused, not dropped
    body = {"steering_vectors": {"post_mlp": {"1": DIR.tolist()}}}
    f = module_from_file("j", json.dumps(body).encode(), "m.json", shape, max_projections=2, as_ablation="true")
    assert not f.has_vectors and f.summary()["projections"] == {"steering_projections": {"post_mlp.1": ["ablate"]}}
    with pytest.raises(SteeringSpecError) as e:
        module_from_file("j", json.dumps({**body, "steering_projections": {"post_mlp.1": [ablate()]}}).encode(),
                         "m.json", shape, max_projections=2, as_ablation="true")
    assert e.value.field == "file.as_ablation" and "leave out the projection fields" in str(e.value)


def test_one_packed_direction_at_many_sites_is_read_once_and_keys_as_if_read_at_each(fe, monkeypatch):
    """The memo of a request's packed directions (a refusal direction at every layer is read once) changes
    neither the rows nor the key: the same request with float lists (never memoised) keys the same; a bad
    direction is still refused naming the first site that gives it."""
    from vllm_steer.frontend import projection_spec
    from vllm_steer.frontend.projection_spec import packed

    reads = []
    real = projection_spec.unit_direction
    monkeypatch.setattr(projection_spec, "unit_direction", lambda *a: reads.append(a[0]) or real(*a))
    sites = ("post_mlp.1", "post_attn.2", "post_mlp.3")
    p, k, _ = fe.resolve({"steering_projections": {s: [{"direction": packed(DIR * 2), "mode": "ablate"}]
                                                   for s in sites}})
    assert len(reads) == 1
    lists, kl, _ = fe.resolve({"steering_projections": {s: [ablate(DIR * 2)] for s in sites}})
    assert len(reads) == 4 and k == kl and p.projections == lists.projections
    for _, _, dirs, _ in _entries(p, k):
        np.testing.assert_allclose(dirs, [UNIT], rtol=1e-6)
    zero = {"direction": packed(np.zeros(D, np.float32)), "mode": "ablate"}
    with pytest.raises(SteeringSpecError) as e:
        fe.resolve({"steering_projections": {"post_attn.2": [zero], "post_mlp.3": [zero]}})
    assert e.value.field == "steering_projections.post_attn.2[0].direction"


def test_a_direction_shared_by_sites_is_one_block_and_the_key_still_follows_every_site(fe):
    """A packed direction ablated at many sites is one bytes block on the wire (copied and hashed once: the key
    hashes a site's directions as their digest), the common tier alone gives both phases the same entries, and
    the key still changes with any one site's direction or with which site holds which."""
    from vllm_steer.frontend.projection_spec import packed

    other = np.roll(DIR, 1)
    sites = ("post_mlp.1", "post_attn.2", "post_mlp.3")
    body = {"steering_projections": {s: [{"direction": packed(DIR), "mode": "ablate"}] for s in sites}}
    p, k, kd = fe.resolve(body)
    entries = p.projections[k]
    assert k == kd and len({id(e[2]) for e in entries}) == 1
    assert fe.resolve({"steering_projections": {s: [ablate()] for s in sites}})[1] == k  # float lists: same key
    raw = DIR.astype("<f4").tobytes()  # a msgpack bin (or a lifted JSON string: server.base64_lift)
    p_raw, k_raw, _ = fe.resolve({"steering_projections": {s: [{"direction": {"dtype": "float32", "data": raw},
                                                                "mode": "ablate"}] for s in sites}})
    assert k_raw == k and len({id(e[2]) for e in p_raw.projections[k]}) == 1
    one_moved = {s: [ablate(other if s == "post_attn.2" else DIR)] for s in sites}
    _, k_moved, _ = fe.resolve({"steering_projections": one_moved})
    swapped = {s: [ablate(DIR if s == "post_attn.2" else other)] for s in sites}
    _, k_swapped, _ = fe.resolve({"steering_projections": swapped})
    assert len({k, k_moved, k_swapped}) == 3
    p_moved = fe.resolve({"steering_projections": one_moved})[0]
    np.testing.assert_allclose(_entries(p_moved, k_moved)[0][2], [other / np.linalg.norm(other)], rtol=1e-6)
