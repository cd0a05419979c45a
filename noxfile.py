"""Nox sessions for flatview.

Every session installs with ``-c constraints/ci.txt`` so torch stays pinned to the CPU build
(an unpinned torch pulls a multi-GB CUDA wheel). Run ``python3 -m nox -l`` to list sessions.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", "constraints/ci.txt")
LINT_PATHS = ("flatview", "tests", "examples", "benchmarks", "noxfile.py")

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests"]


def _install(session: nox.Session, *args: str) -> None:
    # DeepSpeed (the `deepspeed` extra) compiles C++/CUDA ops at install time unless told
    # not to; flatview needs none of them (and tests build none: flatview.testing.
    # deepspeed_on_cpu refuses to).
    session.env["DS_BUILD_OPS"] = "0"
    session.install("--quiet", *CONSTRAINTS, *args)


def _run_script(session: nox.Session, script: str) -> None:
    # Checked before installing anything, so a missing script fails in seconds.
    if not (ROOT / script).is_file():
        session.error(f"{script} does not exist (yet); nothing to run")
    _install(session, "-e", ".[fairscale,demo,deepspeed]")
    session.run(
        "python",
        script,
        *session.posargs,
        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )


def _pytest(session: nox.Session, profile: str) -> None:
    _install(session, "-e", ".[fairscale,test,libs,integrations,deepspeed]")
    # tests/conftest.py skips `slow` tests unless the profile is `thorough` (or --runslow).
    # pytest exits 5 when no test was collected; nox treats any code but 0 as a failure.
    session.run(
        "pytest",
        *session.posargs,
        env={"HYPOTHESIS_PROFILE": profile, "OMP_NUM_THREADS": "1"},
    )


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (Hypothesis profile from $HYPOTHESIS_PROFILE, default `ci`)."""
    _pytest(session, os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@nox.session
def tests_thorough(session: nox.Session) -> None:
    """Run every test, `slow` ones included, with the thorough Hypothesis profile."""
    _pytest(session, "thorough")


@nox.session
def demo(session: nox.Session) -> None:
    """Run the main demo, examples/stochastic_depth.py (posargs go to the script)."""
    _run_script(session, "examples/stochastic_depth.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Run benchmarks/bench_skip.py (posargs go to the script)."""
    _run_script(session, "benchmarks/bench_skip.py")


@nox.session
def bench_whole(session: nox.Session) -> None:
    """Run benchmarks/bench_whole.py: Muon over shards, flatview.optim.Whole against
    all-gathering every gradient (posargs go to the script)."""
    _run_script(session, "benchmarks/bench_whole.py")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check (skips paths that do not exist yet)."""
    paths = [p for p in LINT_PATHS if (ROOT / p).exists()]
    _install(session, "ruff")
    session.run("ruff", "check", *paths, *session.posargs)
    session.run("ruff", "format", "--check", *paths)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the flatview package."""
    _install(session, "-e", ".", "mypy")
    session.run("mypy", "flatview", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the HTML docs into docs/_build/html; warnings are errors."""
    _install(session, "-e", ".[docs]")
    session.run("sphinx-build", "-W", "-b", "html", "docs", "docs/_build/html", *session.posargs)
