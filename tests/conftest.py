import sys

import pytest
import torch

# One thread: two threads collapse when the 2-core machine is shared.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_vllm_engine_outlives_its_test():
    """An in-process vLLM engine holds module-global state and a process group: shut it down after its test."""
    yield
    vllm = sys.modules.get("nemo_jq.rollouts.vllm")
    if vllm is not None:
        vllm.shut_down_engine()
