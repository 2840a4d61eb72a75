"""The fast test tier: ``./run_tests.sh --fast`` (``pytest -m "not slow"``) runs the pure rules, laws, architecture
and CLI checks in a few minutes; CI (``./run_tests.sh``) runs everything.

Every test is ``slow`` unless its file is in :data:`FAST_FILES` and it is not in :data:`SLOW_IN_FAST_FILES`: a new
test file starts in the full tier, so the fast tier cannot grow slow by accident. The lists were drawn from
``--durations`` timings of each file on a loaded 2-core machine (a fast test takes well under a few seconds
there); a test that launches ranks, trains, or enumerates a whole mode's law through the ring is slow.
"""
from __future__ import annotations

import os

import pytest

# One inductor compile worker for the torch.compile tests (tests/test_graphs.py): on a 2-core host with two test
# processes, the default worker pool's processes (each importing torch) cost more CPU than they save. Cold cache,
# the three compile tests alone: 200 CPU-s with the pool, 178 with one worker, wall within 3% (docs/results.md §81).
# Set before torch._inductor reads it; a user's own setting wins.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

FAST_FILES = {
    "test_architecture.py", "test_budget.py", "test_cli.py", "test_device_guard.py", "test_drafter_bench.py",
    "test_drafters.py", "test_emulation.py", "test_hf_compat.py", "test_install.py", "test_kv_messages.py",
    "test_launchers.py", "test_merge_sources.py", "test_outputs.py", "test_prompt_lists.py", "test_sampling.py",
    "test_timeline.py", "test_tool_rows.py", "test_transport.py", "test_tree.py", "test_tree_stats.py",
    "test_tree_vectorised.py", "test_docs_links.py", "test_round_start_bound.py", "test_tree_outputs.py",
    "test_translation_prompts.py", "test_fuzz.py",
}
# (file, test name prefix): the slow tests of those files (seconds: one loaded 2-core run of the file, --durations)
SLOW_IN_FAST_FILES = {
    ("test_cli.py", "test_gpu_head_recipe_help_and_errors"),           # 23 s (bash + a venv probe)
    ("test_cli.py", "test_gpu_goals_help_and_no_cuda"),                # 14 s
    ("test_device_guard.py", "test_decode_paths_create_no_tensor"),    # 13-30 s each (the ring, every mode)
    ("test_drafter_bench.py", "test_bench_on_stories260k"),            # 41 s
    ("test_emulation.py", "test_worker_compute_is_padded"),
    ("test_fuzz.py", "test_drawn_combinations"), ("test_fuzz.py", "test_a_planted"),   # 2-5 s each (the ring)
    ("test_fuzz.py", "test_an_exception"), ("test_fuzz.py", "test_the_ar_reference"),
    ("test_fuzz.py", "test_seeded_sampled"),            # the tiny split + a 0.25 s pad
    ("test_emulation.py", "test_emulated_run_is_exact"),               # 48 s (launches ranks)
    ("test_emulation.py", "test_eval_driver_resumes"),                 # 73 s (launches ranks)
    ("test_launchers.py", "test_fault_through_launcher"),              # 7-60 s each (launches ranks)
    ("test_outputs.py", "test_every_row_carries_provenance"),          # the module's `run` fixture: 42 s
    ("test_outputs.py", "test_output_"),
    ("test_outputs.py", "test_answer_file_is_fastchat"),
    ("test_outputs.py", "test_chrome_trace_export"),
    ("test_outputs.py", "test_one_definition_of_busy"),
    ("test_round_start_bound.py", "test_the_script_counts"),          # 5-14 s (a counted replay)
    ("test_sampling.py", "test_exact_law_every_mode"),                 # 4-8 s each, 60 cases
    ("test_sampling.py", "test_expansion_off_appends_nothing"),        # 19-37 s each
    ("test_sampling.py", "test_chi_square_real_generator"),            # 7-9 s each
    ("test_sampling.py", "test_chi_square_with_a_drafter"),            # 15 s
    ("test_sampling.py", "test_exact_law_reduced_draft_vocabulary"),
    ("test_sampling.py", "test_exact_law_with_a_drafter"),
    ("test_sampling.py", "test_exact_law_drawn"), ("test_sampling.py", "test_broken_verifier_fails_a_drawn"),
    ("test_sampling.py", "test_seeded_runs"), ("test_sampling.py", "test_ar_"),   # the e2e fixture launches ranks
    ("test_sampling.py", "test_threaded_ring"),
    ("test_timeline.py", "test_bench_tiny_model_end_to_end"),          # 57 s (launches ranks)
    ("test_transport.py", "test_gloo_link_frames"),                    # 17 s (a gloo group)
    ("test_tree_stats.py", "test_observed_in_real_modes"),             # 5-7 s each
}


def is_slow(path_name: str, test_name: str) -> bool:
    return path_name not in FAST_FILES or any(
        path_name == f and test_name.startswith(prefix) for f, prefix in SLOW_IN_FAST_FILES)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: the full tier only (./run_tests.sh; --fast leaves it out)")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if is_slow(item.path.name, item.name):
            item.add_marker(pytest.mark.slow)


def pytest_ignore_collect(collection_path, config):
    """The fast tier (``-m "not slow"``) does not even import the files with no fast test (collecting them costs
    about a minute of imports on a loaded 2-core machine)."""
    name = collection_path.name
    if config.option.markexpr.strip() == "not slow" and name.startswith("test_") and name.endswith(".py"):
        return True if name not in FAST_FILES else None
    return None


@pytest.fixture(scope="session")
def stories_server(tmp_path_factory):
    """The stories260K HTTP server (3 launched ranks, oracle drafter, in-process client, --queue-size 16) that
    tests/test_serve.py and tests/test_serve_fields.py share: one launch per test process instead of one per module
    (issue 43). Their tests only send requests to a healthy server and compare each answer with HF or with a
    repeat of itself, so none needs a fresh one; tests that kill or signal a server launch their own."""
    from tests.test_serve import launch_stories_server
    yield from launch_stories_server(tmp_path_factory)
