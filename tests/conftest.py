import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One intra-op thread in every process the suite starts (set before any torch import, inherited
# by subprocesses, torchrun ranks and Ray workers): two test files run at once on 2 cores, and a
# process that asks for 2 threads beside another spins in OpenMP barriers on a core the other
# holds. Measured on the tiny PPO task beside a running suite: 20 s a step at 2 threads, 0.7 s
# at 1 (docs/testing.md). Results were measured over 1 and 2 threads where bars depend on them.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from tests.tiny_models import build_all

    return build_all(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    from tests.tiny_models import build_families

    return build_families(tmp_path_factory.mktemp("family_models"))


# The suite runs two test files at a time (pytest.ini: `-n 2 --dist loadfile`; most tests keep
# one core busy: tiny models and process start-up). Files are handed out in collection order
# (`--no-loadscope-reorder`: xdist would otherwise hand out the files with most tests first, and
# the two single-test acceptance runs, 11 minutes together, ended the run on one worker while
# the other idled), so the longest go first and the short ones fill in around them
# (docs/testing.md has the times).
LONGEST_FIRST = ("test_demo.py", "test_slurm_two_nodes.py", "test_demo_smollm2.py",
                 "test_multi_agent.py", "test_ppo_guard.py", "test_interrupted_runs.py",
                 "test_train_rm.py", "test_ppo_recipes.py", "test_multi_agent_modes.py",
                 "test_ppo.py", "test_ppo_async.py", "test_sft.py", "test_moe_training.py",
                 "test_lora.py", "test_families.py", "test_convert.py", "test_plan.py",
                 "test_tool_turns.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))


def strict_ci() -> bool:
    """True in CI (``CI=true``, or ``REQUIRE_SLURM=1``, both set by ``.ci/run``): there a test that
    needs a real component (Slurm, iproute2, the verl oracle, a linter) fails when it is missing
    instead of skipping, so a green CI means the component really ran."""
    flag = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
    return flag or os.environ.get("REQUIRE_SLURM", "").strip() == "1"


def missing(what: str) -> None:
    """A real component this test needs is absent: fail in CI, skip elsewhere (docs/testing.md
    lists every test that may skip, and why)."""
    if strict_ci():
        pytest.fail(f"CI requires {what}", pytrace=False)
    pytest.skip(what)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI no test skips: a skip that ``missing()`` did not already turn into a failure (an
    ``importorskip``, a ``skipif`` that fired) fails with its reason, so nothing vanishes quietly."""
    outcome = yield
    report = outcome.get_result()
    if strict_ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every test must run: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole file skipped while it is collected (a module-level
    ``importorskip`` or ``pytest.skip(allow_module_level=True)``): in CI that file fails."""
    outcome = yield
    report = outcome.get_result()
    if strict_ci() and report.skipped:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid} skipped in CI, where every test must run: {reason}"


_FILE_SECONDS: dict[str, float] = {}
_WORKER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # Under xdist the controller sees every worker's reports, so this sums per file over the run:
    # with `--dist loadfile` a file's total is the time one worker spends on it.
    name = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration
    node = getattr(report, "node", None)
    worker = getattr(getattr(node, "gateway", None), "id", "main")
    _WORKER_SECONDS[worker] = _WORKER_SECONDS.get(worker, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The files that cost the most worker time, and each worker's total (docs/testing.md reads
    them off CI's log; tests/test_ci_rules.py holds the recorded ones to the budget)."""
    if not _FILE_SECONDS:
        return
    terminalreporter.section("slowest 12 files (setup + call + teardown, one worker each)")
    for name, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:12]:
        terminalreporter.write_line(f"| {seconds:.1f} | `{name}` |")
    terminalreporter.section("busy seconds per worker")
    for worker, seconds in sorted(_WORKER_SECONDS.items()):
        terminalreporter.write_line(f"{worker}: {seconds:.1f} s")
