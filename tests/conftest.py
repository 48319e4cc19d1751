"""How ``pytest -n N`` (pytest-xdist) spreads the suite over its workers.

Work is handed out a group of tests at a time, and each test module is one group, so its
module-scoped fixtures (a server, a cluster, a loaded model) are made once, on one worker. Every
module with a test on a shared e2e server (``SHARED_SERVERS`` in ``tests/e2e/conftest.py``) is in
one group, ``shared-servers``, so those servers start once, on the worker that runs that group,
and the modules keep their order there (some read what an earlier one left, such as the admin
server's model order).

Modules marked ``solo`` (latency bounds that another worker's load would break) form the group
``solo``, handed out last; when it is, the other workers are told to end, and its tests ask for
:func:`machine_to_itself`, which waits until each other worker's session has finished (its last
tests run, its servers stopped: ``pytest_sessionfinish`` leaves a file named after it).

Groups are handed out longest first (LPT: each free worker takes the longest group left), from
``GROUP_COST_S``'s measured seconds, so the two workers end together: xdist orders scopes by
their number of tests, which put the 214 s ``test_paged_kv`` last on one worker while the other
had ended: the workers' ends were 82 s apart, and 15 s apart in the next run, in this order.

pytest-xdist's own ``--dist loadgroup`` cannot do this with pytest 9 (it tags node ids through an
attribute pytest 9 no longer reads), so :func:`pytest_xdist_make_scheduler` returns xdist's
scope scheduler with our groups as the scopes. The workers find the groups at collection (only
they collect) and write them to a file the controller names in the environment.

``make test`` runs two workers with ``OMP_WAIT_POLICY=PASSIVE``. torch's OpenMP threads spin
for a while after each parallel region; beside another busy torch process (a second worker, a
gateway an e2e test started) the spinning threads took the cores from the one with work: a
structured-output test ran 24 s alone, 70 s beside a process multiplying matrices, 30 s with
passive waits. On a 2-core machine the suite took 1,148 s in one process with spinning threads
and 698 s on two workers with passive ones. The variable is set here too, for a plain
``pytest`` run, where torch is not imported yet (the gateways the tests start inherit it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _has_nvidia_gpu() -> bool:
    """Whether ``nvidia-smi -L`` lists a GPU (the Makefile's test), without importing torch."""
    command = shutil.which("nvidia-smi")
    return command is not None and subprocess.run([command, "-L"], capture_output=True).returncode == 0


# Triton kernels (models/triton_attention.py) run on CPU tensors under Triton's interpreter where
# no GPU is: Triton reads the variable when a kernel is decorated, so it is set before any import.
if not _has_nvidia_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from tests.e2e.conftest import uses_a_shared_server  # noqa: E402

SHARED_GROUP = "shared-servers"
SOLO_GROUP = "solo"
SOLO_WAIT_S = 1800  # the longest another worker's last tests may take
GROUPS_PATH_ENV = "SLUICE_TEST_GROUPS_PATH"  # where the workers write {module: group}
DONE_DIR_ENV = "SLUICE_TEST_DONE_DIR"  # where each worker writes a file named after it when it ends
# Seconds each module took on one worker of ``make test`` (2-vCPU AMD EPYC, AVX2 only; the suite
# 1,240 s), the modules over 15 s: only their order matters. A group costs the sum of its
# modules, a module not named here DEFAULT_TEST_COST_S per test.
GROUP_COST_S = {
    "tests/e2e/test_ray_slice.py": 429,
    "tests/e2e/test_paged_kv.py": 214,
    "tests/e2e/test_background_gates.py": 138,
    "tests/e2e/test_deadlines.py": 131,
    "tests/unit/test_compiled_backend.py": 121,
    "tests/e2e/test_fuzz.py": 101,
    "tests/e2e/test_structured_output.py": 95,
    "tests/e2e/test_admin.py": 86,
    "tests/unit/test_structured.py": 85,
    "tests/e2e/test_reconfigure.py": 81,
    "tests/e2e/test_model_residency.py": 80,  # measured beside the other worker, forked servers
    "tests/unit/test_lora_runner.py": 62,  # alone, 2026-12-05 (AVX-512 machine); the LoRA modules below too
    "tests/e2e/test_lora_admin.py": 55,
    "tests/e2e/test_lora.py": 53,
    "tests/e2e/test_process_slices.py": 71,
    "tests/e2e/test_sampling_controls.py": 52,
    "tests/e2e/test_bench_load.py": 48,
    "tests/e2e/test_concurrency.py": 45,
    "tests/unit/test_kv_plan.py": 43,
    "tests/unit/test_lean_backend.py": 42,
    "tests/e2e/test_tools.py": 40,
    "tests/e2e/test_gate.py": 40,
    "tests/e2e/test_isolation.py": 40,
    "tests/e2e/test_choices.py": 33,
    "tests/e2e/test_process_slice_memory.py": 29,
    "tests/e2e/test_slices.py": 27,
    "tests/unit/test_bench_engine.py": 26,
    "tests/e2e/test_slo_tuning.py": 25,
    "tests/unit/test_onnx_backend.py": 25,
    "tests/e2e/test_logprobs.py": 25,
    "tests/e2e/test_dashboard.py": 23,
    "tests/e2e/test_burst.py": 22,
    "tests/e2e/test_metrics.py": 22,
    "tests/e2e/test_admission.py": 21,
    "tests/unit/test_paged_attention.py": 19,
    "tests/e2e/test_bench_peers.py": 18,
    "tests/e2e/test_serve_flags.py": 17,
}
DEFAULT_TEST_COST_S = 0.2


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_configure(config: pytest.Config) -> None:
    """In the controller of a ``-n N`` run, name the file the workers write the groups to
    (a plain run needs no groups)."""
    is_controller = config.getoption("numprocesses", None) and not hasattr(config, "workerinput")
    if is_controller and GROUPS_PATH_ENV not in os.environ:
        handle, path = tempfile.mkstemp(prefix="sluice-test-groups-", suffix=".json")
        os.close(handle)
        os.environ[GROUPS_PATH_ENV] = path
        config.add_cleanup(lambda: Path(path).unlink(missing_ok=True))
        done = tempfile.TemporaryDirectory(prefix="sluice-test-done-")
        os.environ[DONE_DIR_ENV] = done.name
        config.add_cleanup(done.cleanup)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a worker: say it has ended (its tests run, its session fixtures and servers stopped)."""
    worker, done = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(DONE_DIR_ENV)
    if worker and done:
        (Path(done) / worker).touch()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Write each collected module's group (``solo``, ``shared-servers`` or the module's own path)."""
    solo = {_module(item.nodeid) for item in items if item.get_closest_marker("solo") is not None}
    shared = {_module(item.nodeid) for item in items if uses_a_shared_server(item)}
    groups = {
        module: SOLO_GROUP if module in solo else SHARED_GROUP if module in shared else module
        for module in (_module(item.nodeid) for item in items)
    }
    path = os.environ.get(GROUPS_PATH_ENV)
    if path:
        staged = Path(f"{path}.{os.getpid()}")
        staged.write_text(json.dumps(groups))
        staged.replace(path)  # whole or absent: every worker writes the same map


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``gpu`` where torch sees no CUDA device (``bench/gpu_check.sh`` runs
    them on a GPU machine with ``pytest -m gpu``)."""
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler, with a module's group as its scope (read once, when the workers
    have collected and the controller first splits the node ids)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        _groups: dict[str, str] | None = None
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                self._groups = json.loads(Path(os.environ[GROUPS_PATH_ENV]).read_text())
            module = _module(nodeid)
            return self._groups.get(module, module)

        def _assign_work_unit(self, node: Any) -> None:
            if not self._ordered:  # the first assignment: the queue holds every group
                self._ordered = True
                ordered = sorted(
                    self.workqueue.items(), key=lambda item: (item[0] == SOLO_GROUP, -group_cost_s(list(item[1])))
                )
                self.workqueue.clear()
                self.workqueue.update(ordered)
            solo = next(iter(self.workqueue)) == SOLO_GROUP
            super()._assign_work_unit(node)
            if solo and not self.workqueue:  # as xdist does for a worker asking of an empty queue
                for other in self.nodes:
                    if other is not node and not other.shutting_down:
                        other.shutdown()  # it runs the tests it holds, then exits

    return ModuleGroupScheduling(config, log)


def group_cost_s(nodeids: list[str]) -> float:
    """The estimated seconds of a group of tests: its modules' ``GROUP_COST_S``, or
    ``DEFAULT_TEST_COST_S`` per test of a module not named there."""
    modules = {_module(nodeid) for nodeid in nodeids}
    known = sum(GROUP_COST_S[m] for m in modules if m in GROUP_COST_S)
    return known + DEFAULT_TEST_COST_S * sum(_module(nodeid) not in GROUP_COST_S for nodeid in nodeids)


@pytest.fixture
def machine_to_itself() -> None:
    """Under pytest-xdist, wait until every other worker has ended (the ``solo`` group runs last,
    and the others are told to end when it is handed out); at once in a plain run."""
    worker, done = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(DONE_DIR_ENV)
    if not worker or not done:
        return
    from tests.e2e.conftest import wait_for

    others = {f"gw{i}" for i in range(int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))} - {worker}
    wait_for(lambda: others <= {p.name for p in Path(done).iterdir()}, SOLO_WAIT_S, "the other workers ended", poll_s=0.2)
