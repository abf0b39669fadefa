"""Setup for every test, and the tiers' markers (pyproject.toml registers them; docs/testing.md says how to use them).

Most test files mark their own tests. The table below marks tests in files that other work was editing when the
tiers were made (so they were not touched then): it can move into those files, test by test, when convenient.
"""

import sys
from collections import Counter

import pytest
import torch

# One thread: two threads collapse when the 2-core machine is shared.
torch.set_num_threads(1)

#: Markers by test file, then by test function ("*": every test of the file). The durations are of the whole test
#: (all its parameters) on a shared 2-core machine; slow is about 5 s or more.
MARKS: dict[str, dict[str, tuple[str, ...]]] = {
    "test_data.py": {"test_prompts_render_through_the_chat_template_with_thinking_on": ("slow",)},  # 10 s
    "test_doctor.py": {"test_doctor_reports_versions_devices_spec_and_launch": ("slow",),  # 39 s: two doctor processes
                       "test_doctor_says_whether_vllms_cpu_attention_takes_the_models_head_size": ("slow", "vllm")},  # 59 s
    "test_dryrun.py": {"test_the_dry_run_peak_is_the_real_peak": ("slow",),  # 55 s
                       "test_the_command_reports_every_phase_and_refuses_what_does_not_fit": ("slow",),  # 25 s
                       "test_plan_agrees_with_the_dry_run_and_catches_a_micro_batch_counted_in_sequences": ("slow",)},  # 39 s
    "test_dryrun_megatron.py": {"test_the_command_simulates_a_rank_that_samples_none_and_refuses_a_pipelines_refit": ("slow",),
                                "test_plan_activations_agree_with_the_dry_run": ("slow",)},  # 7 s, 5 s
    "test_escape_rates.py": {"test_sgd_is_plain_gradient_descent_without_clipping_and_needs_the_hf_backend": ("slow",),  # 7 s
                             "test_quick_run_measures_p0_per_width_and_another_experiments_option_is_an_error": ("slow",)},
    "test_eval_chunks.py": {"*": ("megatron",),  # 23 s, two gloo ranks
                            "test_a_rank_waiting_for_an_evaluation_call_longer_than_the_collective_timeout_does_not_time_out":
                                ("slow", "distributed")},
    "test_experiment.py": {"test_quick_run_writes_table_summary_and_figures_and_refuses_to_overwrite": ("slow",),  # 71 s
                           "test_unknown_methods_and_malformed_knobs_are_one_line_errors": ("slow",),  # 35 s
                           "test_ctrl_c_stops_the_whole_experiment_not_one_run": ("slow",)},  # 19 s
    "test_export.py": {"test_exported_real_qwen3_template_renders_the_training_prompt": ("slow",)},  # 11 s
    "test_extending.py": {"test_a_one_file_estimator_in_a_package_trains_through_nemo_jq_train": ("slow",),  # 70 s
                          "test_a_backend_that_implements_only_the_protocols_trains_resumes_and_evaluates": ("slow",),  # 16 s
                          "test_the_documented_dataset_prepares_through_a_plugin": ("slow",)},  # 7 s
    "test_guard.py": {"test_a_collapse_restores_the_best_checkpoint_switches_to_paft_and_is_logged": ("slow",),  # 22 s
                      "test_the_guard_switches_to_any_registered_estimator_with_its_defaults": ("slow",)},  # 6 s
    "test_label_noise.py": {"test_a_noisy_run_reports_the_memorisation_of_its_final_and_tested_models": ("slow",)},  # 13 s
    "test_megatron_memory.py": {"*": ("megatron",),
                                "test_the_logprob_head_holds_one_chunk_of_logits_not_the_whole_vocabulary": ("distributed",),
                                "test_the_chunked_head_gives_the_logits_paths_logprobs_and_gradients": ("distributed",),
                                "test_resume_reads_only_this_ranks_shard_of_the_optimizer_state": ("slow", "distributed")},  # 13 s
    "test_off_policy.py": {"test_a_training_step_logs_the_effective_sample_size_of_the_corrected_weights": ("slow",)},  # 15 s
    "test_package.py": {"test_theory_command_writes_tables_json_and_plot": ("slow",),  # 10 s
                        "test_objectives_import_pulls_no_backend": ("slow",),  # 8 s
                        "test_readme_python_example_runs_verbatim": ("slow",)},  # 7 s
    "test_packaging_floors.py": {"test_every_api_the_code_uses_exists_at_the_declared_floor": ("slow",)},  # 20 s
    "test_trainer.py": {"test_eval_and_export_commands": ("slow",),  # 33 s
                        "test_a_signal_writes_a_loadable_checkpoint_and_exits_zero": ("slow",),  # 23 s
                        "test_a_hub_name_resolves_to_its_cached_snapshot_offline_and_an_uncached_one_is_one_line": ("slow",)},
    "test_row_chunks.py": {"test_row_chunks_train_alike_on_two_megatron_pipeline_stages": ("slow", "distributed", "megatron")},
    "test_run_failures.py": {"test_a_second_writer_of_a_held_run_directory_is_one_line_naming_the_holder": ("slow",)},  # 9 s
    "test_vllm_routes.py": {"test_the_installed_vllm_takes_the_reload_route": ("slow", "vllm")},  # 15 s
    # a real SLURM: slurmctld and two slurmd nodes started by the tests (59 s for the two-node run)
    "test_slurm_launch.py": {"*": ("slow", "distributed")},
    "test_sampling_process.py": {"test_each_request_follows_its_refit_and_its_publication": ("slow",)},  # 8 s
}


def _marks_for(item: pytest.Item) -> tuple[str, ...]:
    by_test = MARKS.get(item.path.name, {})
    return by_test.get("*", ()) + by_test.get(getattr(item, "originalname", item.name), ())


def _check_the_table_names_real_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test renamed or removed in its file must leave the table too: else its markers silently go missing."""
    if any("::" in arg for arg in config.args):  # single tests named: the rest of their files were not collected
        return
    collected: dict[str, set[str]] = {}
    for item in items:
        collected.setdefault(item.path.name, set()).add(getattr(item, "originalname", item.name))
    stale = [f"{file}::{name}" for file, by_test in MARKS.items() if file in collected
             for name in by_test if name != "*" and name not in collected[file]]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py MARKS names tests that do not exist: {', '.join(stale)}; "
                                "rename or remove them there")


def _files_with_most_slow_tests_first(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadfile``, as .ci/run runs): the files that hold the most slow tests start
    first, so that no long file is left to start last while the other worker idles. A serial run keeps its order."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    files = sorted(dict.fromkeys(item.path for item in items), key=lambda path: -slow[path])  # stable: ties keep theirs
    order = {path: place for place, path in enumerate(files)}
    items.sort(key=lambda item: order[item.path])


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _check_the_table_names_real_tests(config, items)
    for item in items:
        for name in _marks_for(item):
            item.add_marker(name)
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
def registrations_stay_in_their_test():
    """A plugin a test loads registers its backend, estimator, dataset or rollout engine for the whole process: undo
    that after the test, and forget the modules that registered them (a later test naming the plugin imports it and
    registers it again), so what ran before a test in this process (pytest-xdist gives each worker its own share and
    order) changes nothing it sees, e.g. the names an error lists."""
    from nemo_jq.data.qa import DATASETS
    from nemo_jq.models.backends import BACKENDS
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
