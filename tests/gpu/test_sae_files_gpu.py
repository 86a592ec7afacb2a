"""GPU checks of full SAE packs staged from the formats' own files, as a worker stages them, on the tensor-core
kernels (``full_triton.site_edit``), against the formats' own encode / decode (``tests/sae_file_packs.py``: EleutherAI
sparsify's ``SparseCoder``, Gemma Scope's published JumpReLU); runs only where CUDA is available (sparsify from the
kit's ``.whl/tools``). The CPU twin at small sizes: ``tests/interpreted/test_sae_files_interpreted.py``.

- a padded runtime full pack (NOTES issue 39): an SAE of 1000 features (not a multiple of the 64-feature tiles)
  registered into a 16384-feature reservation that a 16384-feature SAE held before (``SaeTables.load_runtime``:
  zero weights and ``_PAD_BIAS`` past its d_sae), sparsify TopK (k 64) and Gemma Scope JumpReLU, D 4096, N 16 and
  300 (past ``_COMPACT_N``: the ``_compact`` launch), rows RECONSTRUCT / DELTA with every clamp kind;
- a wide sparsify SAE (d_sae 131072 at hidden 4096, k 64: ``_select`` reads pre in chunks, d_sae > ``_SELECT_MAX``)
  loaded at start-up from sparsify's own ``save_to_disk``, at N 1, 16 and 64, then in a CUDA graph captured with
  every row OFF, replayed with the rows and two streams written in place.
Run: ``CHECKS=tests/gpu/test_sae_files_gpu.py bash bench/gpu_session.sh checks``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("full_fp32_matmuls")]

from tests import sae_file_packs as sf  # noqa: E402
from tests.gpu.norm_inputs import full_fp32_matmuls  # noqa: E402,F401

D = 4096
TOL = 1e-3  # of the stream's largest element: the kernels' bf16 hi + lo GEMMs err ~1e-5 of it; a fault is O(1)


@pytest.mark.parametrize("n", [16, 300])
@pytest.mark.parametrize("kind,k", [("sparsify", 64), ("gemma_scope", 0)], ids=["sparsify_topk64", "gemma_scope"])
def test_padded_runtime_full_pack_matches_the_formats_own_code(tmp_path, kind, k, n):
    sf.padded_runtime_case(tmp_path, kind, D, 16384, 1000, k, n, "cuda", TOL)


def test_wide_sparsify_sae_matches_sparsify_eager_and_in_a_cuda_graph(tmp_path):
    from vllm_steer.kernels.sae_clamp import full_triton

    assert 131072 > full_triton._SELECT_MAX  # the chunked search
    sf.wide_sparsify_case(tmp_path, D, 131072, 64, (1, 16, 64), "cuda", TOL, graph=True)
