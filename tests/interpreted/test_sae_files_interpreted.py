"""The CPU twin of ``tests/gpu/test_sae_files_gpu.py`` under Triton's interpreter (run in a subprocess by
``tests/test_steered_norm.py``), at small sizes: a padded runtime full pack (sparsify TopK and Gemma Scope JumpReLU
files, 100 features in a 256-feature reservation that a 256-feature SAE held before) and the chunked TopK search
(``_SELECT_MAX`` lowered to 64: the path of d_sae > 16384 on a GPU) on a sparsify SAE, against sparsify's own encode /
decode and Gemma Scope's published JumpReLU (``tests/sae_file_packs.py``)."""

from __future__ import annotations

import os

import pytest

from tests import sae_file_packs as sf

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]

D = 48
TOL = 1e-3  # the interpreter truncates the bf16 hi + lo split (2^-16): errors ~1e-5 of the stream; a fault is O(1)


@pytest.mark.parametrize("kind,k", [("sparsify", 8), ("gemma_scope", 0)], ids=["sparsify_topk8", "gemma_scope"])
def test_padded_runtime_full_pack_matches_the_formats_own_code(tmp_path, kind, k):
    sf.padded_runtime_case(tmp_path, kind, D, 256, 100, k, 13, "cpu", TOL)


def test_chunked_topk_search_matches_sparsify(tmp_path, monkeypatch):
    from vllm_steer.kernels.sae_clamp import full_triton

    monkeypatch.setattr(full_triton, "_SELECT_MAX", 64)
    monkeypatch.setattr(full_triton, "_SELECT_CHUNK", 64)
    sf.wide_sparsify_case(tmp_path, D, 256, 8, (1, 5, 13), "cpu", TOL, graph=False)
