"""Helpers the benchmarks share (benchmarks/common.py)."""

import torch
import torch._inductor.config as inductor_config

from benchmarks.common import compiled_for_these_kernels


def test_a_compiled_candidate_skips_inductors_cache_where_the_cpu_kernels_are_restricted(monkeypatch):
    """Under ``ATEN_CPU_CAPABILITY=avx2`` a ``torch.compile`` candidate must compile for itself, as the fused kernels
    do: inductor's cache, keyed without the restriction, would hand it the AVX-512 kernels of an unrestricted run."""
    cache_settings = []

    def probe(x):
        cache_settings.append(inductor_config.fx_graph_cache)
        return x + 1

    monkeypatch.setattr(torch, "compile", lambda function, dynamic: function)  # the guard is under test, not inductor
    candidate = compiled_for_these_kernels(probe)
    with inductor_config.patch(fx_graph_cache=True):  # as it is by default, whatever the environment says
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
        assert candidate(torch.ones(2)).tolist() == [2.0, 2.0]
        monkeypatch.delenv("ATEN_CPU_CAPABILITY")
        candidate(torch.ones(2))
    assert cache_settings == [False, True]
