"""``train.micro_batch_rows=auto`` on the machine a run starts on: the most rows ``nemo-jq plan``'s memory model fits
on its GPU (what ``nemo-jq train`` and ``nemo-jq experiment`` hand a Trainer as ``rows_for``)."""

from __future__ import annotations

#: How many of the longest training prompts (by characters) ``train.micro_batch_rows=auto`` tokenizes for the longest.
LONGEST_PROMPTS = 64


def rows_on_this_machine(parts) -> int | None:
    """``train.micro_batch_rows=auto``: the most rows ``nemo-jq plan``'s memory model fits on this GPU at the run's
    layout and longest prompt (of the :data:`LONGEST_PROMPTS` longest by characters, tokenized), said in one line;
    whole groups (null) where it sizes nothing: the CPU, or a model built from scratch."""
    import torch

    from nemo_jq.runtime import distributed

    config, device = parts.config, parts.device
    say = (lambda line: print(f"nemo-jq train: train.micro_batch_rows=auto: {line}", flush=True)) \
        if distributed.is_writer() else (lambda line: None)
    if device.type != "cuda" or not config.model.path:
        say(f"whole groups ({'the CPU' if device.type != 'cuda' else 'a model built from scratch'}: the memory "
            "model sizes a Qwen3 on a GPU)")
        return None
    from nemo_jq.cluster.plan import HEADROOM, auto_micro_batch_rows

    longest = sorted(parts.splits.train, key=lambda e: len(e.question) + len(e.context), reverse=True)[:LONGEST_PROMPTS]
    prompt = max(map(len, parts.prompt_ids(longest)))
    gpu = torch.cuda.get_device_properties(device).total_memory / 2**30
    rows, fitted = auto_micro_batch_rows(config, prompt, gpu, distributed.world_size())
    say(f"{rows} rows ({fitted.total_gib:.1f} of the {HEADROOM * gpu:.4g} GiB usable on {torch.cuda.get_device_name(device)} "
        f"by nemo-jq plan's memory model, prompts of {prompt} tokens)")
    return rows
