"""scripts/benchmark.py builds the same architecture in every implementation."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT

# Depends on the CPU's instruction set: CI runs it again under AVX2 emulation (.ci/run).
pytestmark = pytest.mark.isa


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
    kwargs = benchmark.ARCHS[arch]
    counts = {
        name: sum(p.numel() for p in build(**kwargs).parameters())
        for name, build in benchmark.IMPLS.items()
    }
    ours = {counts[name] for name in counts if name.startswith("ours")}
    assert ours == {counts["timm"]}  # every speed path trains the same parameters
    # vit-pytorch's patch embedding has two LayerNorms more: 2 x (16 + embed_dim) parameters.
    extra = 2 * (benchmark.PATCH**2 + kwargs["embed_dim"])
    assert counts["vit-pytorch"] == counts["timm"] + extra


def test_benchmark_writes_one_section_per_hardware_class(
    benchmark, tmp_path, monkeypatch, one_round_auto
):
    out = tmp_path / "bench.md"
    args = ["--steps", "1", "--reps", "1", "--warmup", "0", "--batch", "8", "--bf16", "no"]
    # Compiling takes minutes: the compiled rows are left out here.
    argv = [*args, "--archs", "default", "--compile-archs", "--out", str(out)]
    from vit_mnist.hardware import isa_class

    # Another machine's section: a class this machine is not, whichever class it is.
    other = "## CPU: Other, class " + ("ARM" if isa_class() != "ARM" else "AVX2") + "; patch 4"
    out.write_text(benchmark.HEADER + f"\n{other}\n\n| old table |\n")
    assert benchmark.main(argv) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| fp32")]
    eager = [
        n
        for n, p in benchmark.PATHS.items()
        if p.unavailable(benchmark.torch.device("cpu")) is None and not p.compiles
    ]
    # Every eager path, the auto row, and both peers.
    assert len(rows) == len(eager) + 1 + 2
    (auto,) = [r for r in rows if "ours (auto: " in r]
    # auto's row is the chosen path's own row: the same model, the same figures.
    chosen = auto.split("auto: ")[1].split(")")[0]
    (own,) = [r for r in rows if f"| ours ({chosen}) |" in r]
    assert auto.split(" | ")[3:] == own.split(" | ")[3:]
    assert f"class {isa_class()}" in text and "torch " in text
    assert "Malloc" not in text  # the allocator choice is gone (docs/speed.md)
    # The other class's section is kept; a second run's section replaces this class's, not
    # adds one (main writes merge(file, section), as above).
    assert other in text
    (section,) = [s for s in text.split("\n## ")[1:] if f"class {isa_class()}" in s]
    again = benchmark.merge(text, "## " + section.replace("| ours", "| again, ours"))
    assert again.count(f"class {isa_class()}") == 1 and "| again, ours" in again
    assert other in again


def test_a_peer_that_fails_to_compile_is_left_out_not_the_run(
    benchmark, monkeypatch, one_round_auto
):
    def fails(**arch):
        raise AssertionError("inductor")  # as torch 2.11's inductor did on CUDA

    impls = {"ours (reference)": benchmark.IMPLS["ours (reference)"], **benchmark.PEER_BUILDERS}
    monkeypatch.setattr(
        benchmark, "implementations", lambda *a: {**impls, "timm (compiled)": fails}
    )
    warmups: dict = {}
    cpu = benchmark.torch.device("cpu")
    args = dict(batch=8, steps=1, reps=1, warmup=0, compile_too=False, warmup_s=warmups)
    results, _ = benchmark.run_row(cpu, False, benchmark.ARCHS["default"], **args)
    assert "timm (compiled)" not in results and "timm" in results
    assert warmups["timm (compiled)"] == "failed (AssertionError), row left out"
    # Ours failing to build still stops the run.
    monkeypatch.setattr(benchmark, "implementations", lambda *a: {"ours (compile)": fails})
    with pytest.raises(AssertionError):
        benchmark.run_row(cpu, False, benchmark.ARCHS["default"], **args)
