"""scripts/benchmark.py builds the same architecture in every implementation."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def benchmark():
    pytest.importorskip("timm")
    pytest.importorskip("vit_pytorch")
    spec = importlib.util.spec_from_file_location("benchmark", ROOT / "scripts" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arch", ["default", "larger"])
def test_same_architecture_same_parameter_count(benchmark, arch):
    (kwargs,) = [a for name, a in benchmark.ARCHS.items() if name.startswith(arch)]
    counts = {
        name: sum(p.numel() for p in build(**kwargs).parameters())
        for name, build in benchmark.IMPLS.items()
    }
    assert counts["ours (explicit)"] == counts["ours (fused)"] == counts["timm"]
    # vit-pytorch's patch embedding has two LayerNorms more: 2 x (16 + embed_dim) parameters.
    extra = 2 * (benchmark.PATCH**2 + kwargs["embed_dim"])
    assert counts["vit-pytorch"] == counts["timm"] + extra


def test_benchmark_writes_a_table_with_every_implementation(benchmark, tmp_path):
    out = tmp_path / "bench.md"
    args = ["--steps", "1", "--reps", "1", "--warmup", "0", "--batch", "8"]
    # Compiling takes minutes: the compiled rows are left out here.
    argv = [*args, "--archs", "default", "--compile-archs", "--out", str(out)]
    assert benchmark.main(argv) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| CPU")]
    assert len(rows) == 2 * len(benchmark.IMPLS)  # fp32 and bf16
    assert "Hardware: CPU:" in out.read_text()
