"""Transformer Engine and the Megatron backend, on CPU: a broken or absent TE is reported and never half used
(checked in fresh processes, the ``scripts_in_their_own_processes`` fixture), recomputed layers run under the
forward's autocast, and the local spec builds every module on the model's device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from megatron_cpu import run_in_processes  # noqa: E402
from megatron_tiny import (  # noqa: E402
    untied_qwen3,
)
from nemo_jq.models.megatron.provider import read_qwen3_config  # noqa: E402

#: Ways an installed Transformer Engine breaks (its 2.x top-level package swallows an ImportError from .pytorch):
#: what its top-level ``__init__`` and its ``pytorch`` subpackage do, and what the reason must name.
BROKEN_TE = {
    "extension-abi": ("try:\n    from . import pytorch\nexcept ImportError:\n    pass\n",
                      "raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN3c10')", "undefined symbol"),
    "cuda-library": ("", "raise OSError('libcudnn_graph.so.9: cannot open shared object file')", "libcudnn_graph"),
    "common-library": ("raise OSError('libcudart.so.13: cannot open shared object file')\n", "", "libcudart"),
    "version-check": ("", "raise AssertionError('TransformerEngine package version mismatch')", "version mismatch"),
    "driver": ("raise RuntimeError('CUDA driver too old')\n", "", "CUDA driver too old"),
    "missing-dependency": ("try:\n    from . import pytorch\nexcept ImportError:\n    pass\n",
                           "import flash_attn_not_installed_here", "flash_attn_not_installed_here"),
}


BROKEN_TE_CHECK = """
import sys, warnings
import torch
torch.cuda.is_available = lambda: True  # as on a GPU node: only TE's breakage decides the spec
import nemo_jq.models.megatron as backend
assert "megatron.core" not in sys.modules
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    status = backend.transformer_engine_status()
assert status.startswith("unusable (") and {reason!r} in status, status
assert any({reason!r} in str(w.message) for w in caught)
import megatron.core
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import transformer_block
from nemo_jq.models.megatron.provider import uses_transformer_engine
assert not gpt_layer_specs.HAVE_TE and not transformer_block.HAVE_TE and not uses_transformer_engine()
"""


def broken_te_script(folder: Path, mode: str) -> dict:
    """The check of one way TE breaks: its packages written under ``folder``, first on the script's import path."""
    top, subpackage, reason = BROKEN_TE[mode]
    (folder / "transformer_engine" / "pytorch").mkdir(parents=True)
    (folder / "transformer_engine" / "__init__.py").write_text(top)
    (folder / "transformer_engine" / "pytorch" / "__init__.py").write_text(subpackage + "\n")
    return {"code": BROKEN_TE_CHECK.format(reason=reason), "path": [folder],
            "env": {"PYTHONPATH": os.pathsep.join([str(folder), *sys.path])}}


@pytest.fixture(scope="module")
def scripts_in_their_own_processes(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The checks below that need a process that has not imported megatron-core (nor TE) yet, each in its own, run
    together: forked from one Python (``helpers.run_scripts``) rather than a new interpreter each. Every test that
    takes this fixture is marked slow, since any one of them runs them all."""
    from helpers import run_scripts

    scripts = {f"broken-te:{mode}": broken_te_script(tmp_path_factory.mktemp("te"), mode) for mode in BROKEN_TE}
    scripts["no-te"] = {"code": NO_TE_CHECK}
    here = Path(__file__).resolve().parent  # megatron_tiny; megatron_cpu and helpers are in tests/
    scripts["recompute"] = {"code": RECOMPUTE_UNDER_AUTOCAST.format(paths=[str(here.parents[1]), str(here)])}
    return dict(zip(scripts, run_scripts(list(scripts.values())), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(BROKEN_TE))
def test_a_broken_transformer_engine_is_reported_and_never_half_used(mode, scripts_in_their_own_processes):
    """Whatever breaks TE, megatron.core still imports with none of its TE paths, and the policy picks the
    local layer spec even where CUDA is available (the check imports transformer_engine.pytorch itself)."""
    result = scripts_in_their_own_processes[f"broken-te:{mode}"]
    assert result.returncode == 0, result.stderr[-2000:]


NO_TE_CHECK = ("import sys, nemo_jq.models.megatron as b; assert 'megatron.core' not in sys.modules; "
               "print(b.transformer_engine_status())")


@pytest.mark.slow
def test_no_transformer_engine_is_not_installed_and_imports_nothing(scripts_in_their_own_processes):
    result = scripts_in_their_own_processes["no-te"]
    assert result.returncode == 0 and result.stdout.strip() == "not installed", result.stderr[-2000:]


def devices_of_a_gpu_build() -> list[str]:
    """Build as on a GPU (no CPU initialisation), with the "current CUDA device" standing in as ``meta``."""
    from megatron.core import parallel_state

    from nemo_jq.models.megatron.provider import build_gpt_model

    parallel_state.initialize_model_parallel()
    torch.cuda.current_device = lambda: "meta"
    model = build_gpt_model(read_qwen3_config(untied_qwen3().config), use_cpu_initialization=False)
    return sorted({str(tensor.device) for tensor in [*model.parameters(), *model.buffers()]})


@pytest.mark.distributed
@pytest.mark.slow  # 6 s
def test_the_local_spec_builds_every_module_on_the_models_device():
    """megatron-core's WrappedTorchNorm builds its norms on CPU whatever the device (the first GPU forward then mixes
    devices); the package's own norm follows the device the rest of the model is built on."""
    assert run_in_processes(devices_of_a_gpu_build, 1) == [["meta"]]


RECOMPUTE_UNDER_AUTOCAST = """
import sys, tempfile
import torch
# As on a GPU: megatron-core's linears re-enter the forward's autocast in their own backward (custom_fwd/custom_bwd
# name device "cuda"); pointing them at CPU autocast makes this CPU run take the GPU's code path.
_fwd, _bwd = torch.amp.custom_fwd, torch.amp.custom_bwd
torch.amp.custom_fwd = lambda fwd=None, *, device_type, cast_inputs=None: _fwd(fwd, device_type="cpu", cast_inputs=cast_inputs)
torch.amp.custom_bwd = lambda bwd=None, *, device_type: _bwd(bwd, device_type="cpu")
sys.path[:0] = {paths!r}
from megatron_cpu import patch_megatron_for_cpu
patch_megatron_for_cpu()
torch.distributed.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
from megatron_tiny import garl_batch, garl_loss_fn, untied_qwen3, SAMPLES, PROMPTS
from nemo_jq.models.megatron.policy import MegatronPolicy

def gradients(recompute):
    model = untied_qwen3()
    policy = MegatronPolicy.from_hf_model(model, recompute_activations=recompute, precision="bf16")
    batch = garl_batch(model.config.vocab_size)
    policy.forward_backward([batch], garl_loss_fn([batch], []))  # forward under bf16 autocast, backward outside
    return {{name: param.grad.clone() for name, param in policy.model.named_parameters()}}

plain, recomputed = gradients(False), gradients(True)
worst = max(float((plain[name] - recomputed[name]).abs().max()) for name in plain)
print("worst", worst)
assert worst == 0.0, worst
"""


@pytest.mark.slow
def test_recomputed_layers_run_under_the_forwards_autocast(scripts_in_their_own_processes):
    """Full recomputation under bf16 autocast (the GPU default, fp32 weights): megatron-core's checkpoint re-ran the
    layers outside autocast, on bf16 saved inputs (a dtype error in the local spec's linears); the gradients now
    equal those without recomputation, bit for bit."""
    result = scripts_in_their_own_processes["recompute"]
    assert result.returncode == 0, result.stderr[-3000:]
