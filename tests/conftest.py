"""Setup for every test under tests/ (its folders: docs/testing.md): one thread, and under pytest-xdist the files
with the most slow tests first. Each test file marks its own tests with the tiers' markers (pyproject.toml registers
them). This folder is on the import path (pytest's rootdir conftest), so tests in any subfolder import the shared
helpers here (``helpers``, ``megatron_cpu``, ``latent_pools``, ``doc_pages``) by name.
"""

import sys
from collections import Counter

import pytest
import torch

# One thread: two threads collapse when the 2-core machine is shared.
torch.set_num_threads(1)


def _files_with_most_slow_tests_first(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadfile``, as .ci/run runs): the files that hold the most slow tests start
    first, so that no long file is left to start last while the other worker idles. A serial run keeps its order."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    files = sorted(dict.fromkeys(item.path for item in items), key=lambda path: -slow[path])  # stable: ties keep theirs
    order = {path: place for place, path in enumerate(files)}
    items.sort(key=lambda item: order[item.path])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike, as xdist requires
        _files_with_most_slow_tests_first(items)


@pytest.fixture(autouse=True)
def no_vllm_engine_outlives_its_test():
    """An in-process vLLM engine holds module-global state and a process group: shut it down after its test."""
    yield
    vllm = sys.modules.get("nemo_jq.rollouts.vllm")
    if vllm is not None:
        vllm.shut_down_engine()


@pytest.fixture(autouse=True)
def warnings_said_once_start_afresh():
    """A config warning is said once a process (``nemo_jq.config._ANNOUNCED``): each test starts as a fresh command
    does, whatever ran before it in this worker."""
    config = sys.modules.get("nemo_jq.config")
    if config is not None:
        config._ANNOUNCED.clear()


@pytest.fixture(autouse=True)
def registrations_stay_in_their_test():
    """A plugin a test loads registers its backend, estimator, dataset or rollout engine for the whole process: undo
    that after the test, and forget the modules that registered them (a later test naming the plugin imports it and
    registers it again), so what ran before a test in this process (pytest-xdist gives each worker its own share and
    order) changes nothing it sees, e.g. the names an error lists."""
    from nemo_jq.backends import BACKENDS
    from nemo_jq.data.qa import DATASETS
    from nemo_jq.objectives import registry
    from nemo_jq.rollouts import SAMPLERS

    registries = [BACKENDS, DATASETS, SAMPLERS, registry._REGISTRY]
    before, modules = [set(names) for names in registries], set(sys.modules)
    yield
    registering = set()
    for names, known in zip(registries, before):
        for name in set(names) - known:
            entry = names.pop(name)
            registering.add(getattr(getattr(entry, "fn", entry), "__module__", None))
    for module in set(sys.modules) - modules:
        if any(module == owner or (owner or "").startswith(module + ".") for owner in registering):
            del sys.modules[module]
