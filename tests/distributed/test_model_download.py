"""Issue 43's N2: a hub model is downloaded once, by torchrun's rank 0, while every rank waits, a split world's
rollout ranks too; a rank that cannot see rank 0's cache says HF_HOME. Two real processes over gloo, in the split world
``rollout.placement=separate`` makes; the hub is a fake (no network here): a "download" that takes a second and
writes a folder, and a cache lookup that finds it only once written."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from megatron_cpu import free_port

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent('''
    import os, sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch
    from nemo_jq.recipe import components
    from nemo_jq.runtime import distributed

    cache, local = Path(sys.argv[1]), sys.argv[2] == "node-local"
    rank = int(os.environ["RANK"])

    def fake_hub(path, *, local_files_only=False):
        seen = cache / f"rank{rank}" if local and rank else cache  # node-local: rank 1 looks in its own
        if not local_files_only:
            time.sleep(1.0)  # a slow download
            cache.mkdir(parents=True, exist_ok=True)
            return cache
        if not seen.exists():
            raise FileNotFoundError(f"model.path={path} is not in the local Hugging Face cache")
        return seen

    components.resolve_pretrained = fake_hub
    distributed.init_from_env(torch.device("cpu"), timedelta(seconds=60), rollout_ranks=1)
    try:
        print("resolved", components.resolve_model_dir("Qwen/Qwen3-8B"), flush=True)
    except FileNotFoundError as error:
        print("error", error, flush=True)
    # the groups ended as a command that succeeded ends them: left to their destructors, a gloo group torn down while
    # its peer still closes its side ended this worker in "terminate called without an active exception" 1 run in 2
    distributed.close()
''')


def _run_split_world(tmp_path: Path, mode: str) -> list[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "hub"), mode], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for rank in range(2)]
    outs = [proc.communicate(timeout=120) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outs]
    return [out.strip().splitlines()[-1] for out, _ in outs]


def test_a_rollout_rank_waits_for_rank_0_s_download(tmp_path):
    trainer, rollout_rank = _run_split_world(tmp_path, "shared")
    assert trainer == rollout_rank == f"resolved {tmp_path / 'hub'}"


def test_a_rank_that_cannot_see_rank_0_s_cache_names_hf_home(tmp_path):
    trainer, rollout_rank = _run_split_world(tmp_path, "node-local")
    assert trainer == f"resolved {tmp_path / 'hub'}"
    assert rollout_rank.startswith("error model.path=Qwen/Qwen3-8B: rank 0 has it in its Hugging Face cache, which "
                                   "this rank (rank 1 on ") and "HF_HOME=" in rollout_rank, rollout_rank
