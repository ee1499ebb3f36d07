from __future__ import annotations

from pathlib import Path

import pytest
from train_checks import check_finished, reduced, train


@pytest.fixture(scope="session")
def finished_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished 2-iteration quickstart run (a checkpoint per iteration, evaluated each), shared
    by the tests that only read a run; a test that changes it works on a copy (``copy_run``)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    check_finished(train(reduced(tiny_model_dir, run)), run, 2)
    return run


@pytest.fixture
def copy_run(finished_run: Path, tmp_path: Path):
    """A private copy of ``finished_run`` to damage or extend."""
    import shutil

    def copy(name: str = "run") -> Path:
        return Path(
            shutil.copytree(
                finished_run, tmp_path / name, ignore=shutil.ignore_patterns("evals", "view.html")
            )
        )

    return copy
