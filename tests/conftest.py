"""How ``pytest -n N`` (pytest-xdist) spreads the suite over its workers.

Work is handed out a group of tests at a time, and each test module is one group, so its
module-scoped fixtures (a server, a cluster, a loaded model) are made once, on one worker. Every
module with a test on a shared e2e server (``SHARED_SERVERS`` in ``tests/e2e/conftest.py``) is in
one group, ``shared-servers``, so those servers start once, on the worker that runs that group,
and the modules keep their order there (some read what an earlier one left, such as the admin
server's model order).

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
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from tests.e2e.conftest import uses_a_shared_server  # noqa: E402

SHARED_GROUP = "shared-servers"
GROUPS_PATH_ENV = "SLUICE_TEST_GROUPS_PATH"  # where the workers write {module: group}


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Write each collected module's group (``shared-servers`` or the module's own path)."""
    shared = {_module(item.nodeid) for item in items if uses_a_shared_server(item)}
    groups = {_module(item.nodeid): SHARED_GROUP if _module(item.nodeid) in shared else _module(item.nodeid) for item in items}
    path = os.environ.get(GROUPS_PATH_ENV)
    if path:
        staged = Path(f"{path}.{os.getpid()}")
        staged.write_text(json.dumps(groups))
        staged.replace(path)  # whole or absent: every worker writes the same map


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler, with a module's group as its scope (read once, when the workers
    have collected and the controller first splits the node ids)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                self._groups = json.loads(Path(os.environ[GROUPS_PATH_ENV]).read_text())
            module = _module(nodeid)
            return self._groups.get(module, module)

    return ModuleGroupScheduling(config, log)
