"""The package's rooms: imports run one way, and the README's Layout names every file."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Every module of the package in its own layer, from the entry points down: a module may
# import only modules listed below it. The comments name the rooms.
LAYERS: list[str] = [
    # the entry points and Hydra's errors in one line
    "vit_mnist.cli",
    "vit_mnist.hydra_errors",
    # the tasks: what a user runs (no task imports another: see TASKS below)
    "vit_mnist.tasks",
    "vit_mnist.tasks.explore",
    "vit_mnist.tasks.explore.server",
    "vit_mnist.tasks.explore.page",
    "vit_mnist.tasks.explore.session",
    "vit_mnist.tasks.predict",
    "vit_mnist.tasks.evaluate",
    "vit_mnist.tasks.evaluate.report",
    "vit_mnist.tasks.evaluate.analyses",
    "vit_mnist.tasks.evaluate.pruning",
    "vit_mnist.tasks.train",
    "vit_mnist.tasks.export",
    # the training run's parts
    "vit_mnist.training",
    "vit_mnist.training.callbacks",
    "vit_mnist.training.callbacks.save_on_interrupt",
    "vit_mnist.training.callbacks.attention_maps",
    "vit_mnist.training.callbacks.throughput",
    "vit_mnist.training.callbacks.trial_pruning",
    "vit_mnist.training.checks",
    "vit_mnist.training.checkpointing",
    "vit_mnist.training.module",
    "vit_mnist.training.schedule",
    "vit_mnist.training.distillation",
    # the speed layer, which wraps the reference model
    "vit_mnist.speed.choose",
    "vit_mnist.speed.stored_choices",
    "vit_mnist.speed.native",
    "vit_mnist.speed.forward",
    # the analyses, and the pictures they draw
    "vit_mnist.analysis",
    "vit_mnist.analysis.pruning",
    "vit_mnist.analysis.heads",
    "vit_mnist.analysis.per_class",
    "vit_mnist.analysis.explain",
    "vit_mnist.analysis.faithfulness",
    "vit_mnist.analysis.roles",
    "vit_mnist.analysis.attention",
    "vit_mnist.analysis.patching",
    "vit_mnist.analysis.logit_lens",
    "vit_mnist.analysis.logit_attribution",
    "vit_mnist.analysis.components",
    "vit_mnist.analysis.relevance",
    "vit_mnist.analysis.distillation",
    "vit_mnist.analysis.modes",
    "vit_mnist.analysis.drawing",
    # the textbook model and the data
    "vit_mnist.models",
    "vit_mnist.models.vit",
    "vit_mnist.models.stem",
    "vit_mnist.models.checks",
    "vit_mnist.models.cnn",
    "vit_mnist.models.attention",
    "vit_mnist.data",
    "vit_mnist.data.mnist",
    "vit_mnist.data.synthetic",
    "vit_mnist.data.base",
    "vit_mnist.data.augment",
    "vit_mnist.data.images",
    "vit_mnist.data.sources",
    # what every room may use: the package root
    "vit_mnist.settings",
    "vit_mnist.errors",
    "vit_mnist.console",
    "vit_mnist.hardware",
    "vit_mnist.speed",
    "vit_mnist.io",
    "vit_mnist",
]

# The package root holds the cross-cutting base alone: everything else lives in a room.
MAX_ROOT_MODULES = 8
# A function a reader can hold in their head, docstring included.
MAX_FUNCTION_LINES = 80


def layer_of(module: str) -> int:
    """Index of ``module`` in LAYERS (0 is the top)."""
    if module not in LAYERS:
        raise AssertionError(f"{module} is in no layer of tests/test_layout.py: add it")
    return LAYERS.index(module)


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((ROOT / "vit_mnist").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def imported(path: Path) -> set[str]:
    """The vit_mnist modules that ``path`` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    modules = package_modules()
    return {n for n in names if n in modules}


def upward_imports() -> list[str]:
    """The imports of a module listed at or above the importer in LAYERS."""
    upward = []
    for module, path in package_modules().items():
        mine = layer_of(module)
        for target in imported(path):
            if target != module and layer_of(target) <= mine:
                upward.append(f"{module} imports {target}, which is listed above it")
    return upward


def test_imports_run_from_the_entry_points_down():
    upward = upward_imports()
    assert not upward, "imports that run upwards:\n" + "\n".join(upward)
    stale = sorted(set(LAYERS) - set(package_modules()))
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def import_circles() -> list[list[str]]:
    """The groups of modules that import each other, directly or through others (a
    package's ``__init__`` re-exporting its own modules aside)."""
    graph = {
        m: [t for t in imported(p) if t != m and not t.startswith(m + ".")]
        for m, p in package_modules().items()
    }

    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph.get(start, []))
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, []))
        return seen

    reached = {m: reach(m) for m in graph}
    circles = {
        tuple(sorted(n for n in reached[m] if m in reached.get(n, ())))
        for m in graph
        if m in reached[m]
    }
    return sorted(map(list, circles))


def test_no_module_imports_itself_through_others():
    assert import_circles() == []


def test_the_circle_check_catches_a_circle(monkeypatch, tmp_path):
    # io importing errors again (errors imports io) would be a circle.
    fake = tmp_path / "io.py"
    fake.write_text("from vit_mnist.errors import ConfigError\n")
    modules = package_modules()
    monkeypatch.setattr(
        "tests.test_layout.package_modules", lambda: {**modules, "vit_mnist.io": fake}
    )
    assert ["vit_mnist.errors", "vit_mnist.io"] in import_circles()


def test_the_layer_check_catches_an_upward_import(monkeypatch, tmp_path):
    # The check above must be able to fail: a models file importing the trainer would.
    fake = tmp_path / "vit.py"
    fake.write_text("from vit_mnist.tasks.train import train\n")
    modules = package_modules()
    monkeypatch.setattr(
        "tests.test_layout.package_modules", lambda: {**modules, "vit_mnist.models.vit": fake}
    )
    assert upward_imports() == [
        "vit_mnist.models.vit imports vit_mnist.tasks.train, which is listed above it"
    ]


def root_modules(root: Path = ROOT / "vit_mnist") -> list[str]:
    """The modules that stand directly in the package root, ``__init__`` among them."""
    return sorted(p.name for p in root.glob("*.py"))


def test_the_package_root_holds_only_the_base():
    modules = root_modules()
    assert len(modules) <= MAX_ROOT_MODULES, (
        f"{len(modules)} modules at the package root ({', '.join(modules)}), more than "
        f"{MAX_ROOT_MODULES}: put the new one in the room of its job (tasks/, training/, ...)"
    )


def test_the_root_check_counts_a_ninth_module(tmp_path):
    for name in [*root_modules(), "results.py"]:
        (tmp_path / name).write_text("")
    assert len(root_modules(tmp_path)) == MAX_ROOT_MODULES + 1


def task_of(module: str) -> str | None:
    """The task a module belongs to (``train`` for ``vit_mnist.tasks.train``, ``explore``
    for ``vit_mnist.tasks.explore.session``), None outside vit_mnist.tasks."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["vit_mnist", "tasks"] and len(parts) > 2 else None


def cross_task_imports(modules: dict[str, Path] | None = None) -> list[str]:
    """Imports from one task's modules into another task's."""
    found = []
    for module, path in (modules or package_modules()).items():
        mine = task_of(module)
        for target in imported(path):
            theirs = task_of(target)
            if mine and theirs and theirs != mine:
                found.append(f"{module} imports {target}: move what both need into a part")
    return found


def test_no_task_imports_another_task():
    found = cross_task_imports()
    assert not found, "\n".join(found)


def test_the_task_check_catches_one_task_importing_another(tmp_path):
    fake = tmp_path / "session.py"
    fake.write_text("from vit_mnist.tasks.predict import load_model\n")
    modules = {**package_modules(), "vit_mnist.tasks.explore.session": fake}
    assert cross_task_imports(modules) == [
        "vit_mnist.tasks.explore.session imports vit_mnist.tasks.predict: move what both "
        "need into a part"
    ]


def long_functions(paths: list[Path] | None = None) -> list[str]:
    """Functions and methods longer than :data:`MAX_FUNCTION_LINES`, from ``def`` to their
    last line."""
    found = []
    for path in paths or sorted((ROOT / "vit_mnist").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                    found.append(f"{where}:{node.lineno} {node.name} ({lines})")
    return found


def test_no_function_is_longer_than_a_reader_can_hold():
    found = long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_the_length_check_counts_the_docstring(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 3))
    fits = tmp_path / "fits.py"
    fits.write_text(f'def f():\n    """Doc."""\n{body}\n    return x0\n')
    assert long_functions([fits]) == []
    over = tmp_path / "over.py"
    over.write_text(f'def f():\n    """Doc\n    on two lines."""\n{body}\n    return x0\n')
    assert long_functions([over]) == [f"{over}:1 f ({MAX_FUNCTION_LINES + 1})"]


def readme_layout_paths() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    paths = []
    for line in block.splitlines()[1:]:
        if not line or line[0].isspace():
            continue  # a description continued from the line above
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        paths += [p.strip() for p in head.split(",")]
    return paths


def test_readme_layout_matches_git_ls_files():
    try:
        tracked = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    listed = readme_layout_paths()
    assert listed, "README's Layout section lists no paths"

    def covers(entry: str, file: str) -> bool:
        return file == entry or (entry.endswith("/") and file.startswith(entry))

    missing = [e for e in listed if not any(covers(e, f) for f in tracked)]
    assert not missing, f"README's Layout names paths that git does not track: {missing}"
    unlisted = [f for f in tracked if not any(covers(e, f) for e in listed)]
    assert not unlisted, f"tracked files that README's Layout does not name: {unlisted}"


def _broken_links(markdown: Path) -> list[str]:
    """The relative links of a Markdown file whose target (a file or folder, the anchor
    left out) does not exist, resolved from the file's own folder as a reader's viewer
    resolves them."""
    text = markdown.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z]+:", path):  # an anchor here, or a URL
            continue
        if not (markdown.parent / path).exists():
            broken.append(target)
    return broken


def test_links_in_the_docs_resolve():
    # Issue 102: docs/explorer_guide.md linked docs/explorer.md, from docs/.
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = {str(f.relative_to(ROOT)): b for f in files if (b := _broken_links(f))}
    assert not broken


def test_the_link_check_catches_a_link_from_the_wrong_folder(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("[b](b.md) [c](docs/b.md) [web](https://x.y/z)")
    (tmp_path / "docs" / "b.md").write_text("")
    assert _broken_links(tmp_path / "docs" / "a.md") == ["docs/b.md"]
