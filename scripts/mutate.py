"""Mutation testing (`make mutate`) of the modules where a silent bug costs users most.

Each module is mutated by mutmut 3 in a work tree of its own, extracted from the repository's
HEAD (`git archive`), never in the working tree: other people run tests there, and a score
belongs to a commit. The operator's and the loader's packages are copied to the work tree's
root, beside `hotload/`, so that mutmut names each mutant by the module the tests import.
Each module runs only the tests that exercise it, under a wall-clock limit; mutants left
unchecked when the limit ends the run are counted and reported, never silently dropped.

    usage: .venv/bin/python scripts/mutate.py [--modules NAME,NAME] [--limit SECONDS]
                                              [--work DIR] [--jobs N] [--sample DIGITS]
    make mutate [MODULES=ledger-model,rollup] [MUTATE_LIMIT=900] [MUTATE_SAMPLE=05]

`hotload_patch/vllm.py` is not a module here: it runs only inside a vLLM worker, which its
tests start in a process of its own, so no mutant of it would ever be reached.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Where each package lives in the repository, and where it goes in the work tree.
PACKAGES = {
    "hotload": "hotload",
    "hotload_patch": "hotload_patch",
    "operator/hotload_operator": "hotload_operator",
    "sidecar/hotload_sidecar": "hotload_sidecar",
}


@dataclass(frozen=True)
class Module:
    """One mutated module: its file in the work tree and the tests that exercise it."""

    name: str
    path: str
    tests: tuple[str, ...]
    #: mutmut's `process_isolation`: "forkserver" where the tests start threads (torch's, a
    #: cached write pool) that a worker forked from the process that ran them would inherit
    #: dead, hanging its first test that waits on one.
    isolation: str = "fork"


def _core(*names: str) -> tuple[str, ...]:
    """Tests of tests/test_patch_core.py by name (each with all its parameters)."""
    return tuple(f"tests/test_patch_core.py::test_{name}" for name in names)


#: A patch staged, verified and written on every rank of each engine layout (test_patch_core.py).
EVERY_RANK = ("a_patch_on_every_rank_gives_what_a_full_load_of_the_child_gives",)
#: The scrub's in-process tests (its `hotload serve` flags run in a process of their own).
SCRUB = tuple(
    f"tests/test_patch_scrub.py::test_{name}"
    for name in (
        "derived_sums_equal_a_full_reread_after_patches",
        "a_scrub_finds_a_flipped_bit_and_patches_are_refused_until_a_full_load",
        "the_scrub_reads_at_its_rate_and_rereads_what_a_patch_changed_under_it",
        "sums_on_the_device_equal_zlibs",
        "by_default_the_scrub_rests_an_hour_after_a_full_load",
        "a_scrub_with_a_short_period_rests_between_passes_and_finds_a_flipped_bit_within_it",
        "a_pass_that_skips_a_region_says_so_and_does_not_count_it_as_read",
    )
)

MODULES: tuple[Module, ...] = (
    Module("ledger-model", "hotload/ledger/model.py", ("tests/test_ledger.py",)),
    Module(
        "rollup",
        "hotload_operator/rollup.py",
        ("tests/test_operator_unit.py", "tests/test_operator_causes.py"),
    ),
    Module("causes", "hotload_operator/causes.py", ("tests/test_operator_causes.py",)),
    # In-process loaders only: a loader in a process of its own imports the unmutated code.
    # test_volume.py runs `Volume` on a real folder and ledger; test_sidecar_flow.py drives the
    # update flow and its paths with a real loader and reference engine in the test's process.
    # From the fork server: the loader's tests start the materializer's and the codec's
    # threads (a worker forked after them timed out on every mutant).
    Module("volume", "hotload_sidecar/volume.py", ("tests/test_volume.py",), "forkserver"),
    Module("updates", "hotload_sidecar/updates.py", ("tests/test_sidecar_flow.py",), "forkserver"),
    Module(
        "chained",
        "hotload_sidecar/chained.py",
        ("tests/test_sidecar_flow.py", "tests/test_sidecar_pipeline.py"),
        "forkserver",
    ),
    Module(
        "ahead",
        "hotload_sidecar/ahead.py",
        (
            "tests/test_sidecar_flow.py",
            "tests/test_sidecar_pipeline.py",
            "tests/test_sidecar_status_ahead.py",
        ),
        "forkserver",
    ),
    # The replica status the loader keeps (what the operator rolls up): the behind clock and
    # the board's rules one by one (test_sidecar_board_mutants.py), the patch prepared ahead and
    # the behind gauge with in-process loaders.
    Module(
        "board",
        "hotload_sidecar/board.py",
        (
            "tests/test_sidecar_board_mutants.py",
            "tests/test_sidecar_behind.py",
            "tests/test_sidecar_status_ahead.py",
        ),
        "forkserver",
    ),
    # test_patch_mutants.py reads every field and check of the reader; test_arc_patch.py patch
    # files the writer made and damaged ones; test_patch_stage_threads.py a patch decoded in
    # threads (test_patch_core.py as a whole left a third of the sample unchecked in 540 s).
    Module(
        "patch-format",
        "hotload_patch/format.py",
        (
            "tests/test_patch_mutants.py",
            "tests/test_arc_patch.py",
            "tests/test_patch_stage_threads.py",
        ),
        "forkserver",
    ),
    # The regions' and sums' tests of test_patch_core.py by name, the sums on the device and
    # derived after patches (test_patch_scrub.py), test_patch_mutants.py and
    # test_patch_sums_mutants.py.
    Module(
        "patch-sums",
        "hotload_patch/sums.py",
        (
            "tests/test_patch_sums_mutants.py",
            "tests/test_patch_mutants.py",
            *_core(
                "region_of_narrow_transpose_select_views_matches_as_strided",
                "region_of_any_slice_view_matches_as_strided",
                "nested_accepts_step_slices",
                "region_whole_and_overlap",
                "partial_sums_of_shards_combine_into_adler32",
                "replicas_that_differ_are_a_parent_mismatch_and_gaps_a_weights_mismatch",
                "delta_partial_moves_adler32_as_the_edit_does",
                "delta_partial_of_a_tensor_too_big_to_build",
                "served_sums_do_not_depend_on_how_much_is_read_at_once",
                *EVERY_RANK,
            ),
            "tests/test_patch_scrub.py::test_sums_on_the_device_equal_zlibs",
            "tests/test_patch_scrub.py::test_derived_sums_equal_a_full_reread_after_patches",
        ),
        "forkserver",
    ),
    # The parent and result checks over every rank's sums: each check on sums made from bytes
    # (test_patch_verify_mutants.py), the tests of test_patch_core.py that call `verify` or
    # stage through a `Patcher`, and test_patch_mutants.py.
    Module(
        "patch-verify",
        "hotload_patch/verify.py",
        (
            "tests/test_patch_verify_mutants.py",
            "tests/test_patch_mutants.py",
            *_core(
                *EVERY_RANK,
                "a_rank_not_serving_the_parent_is_a_parent_mismatch",
                "a_flipped_value_in_the_patch_is_a_checksum_mismatch",
                "a_tensor_whose_changes_are_lost_from_the_patch_is_a_checksum_mismatch",
                "patcher_stages_verifies_applies_and_rolls_back",
                "the_worker_extension_patches_every_rank_over_json",
            ),
        ),
        "forkserver",
    ),
    # The served weights' sums on the CPU and by the device's integer path (test_patch_scrub.py
    # runs the latter on the CPU), the held dtype's checks, the counters.
    Module(
        "patch-served",
        "hotload_patch/served.py",
        (
            "tests/test_patch_served_mutants.py",
            "tests/test_patch_mutants.py",
            *_core(
                *EVERY_RANK,
                "served_sums_do_not_depend_on_how_much_is_read_at_once",
                "a_float32_checkpoint_held_as_bfloat16_is_refused",
                "a_rank_not_serving_the_parent_is_a_parent_mismatch",
                "patcher_stages_verifies_applies_and_rolls_back",
            ),
            *SCRUB,
        ),
        "forkserver",
    ),
    # `Patcher` and `derive`: its tests in test_patch_core.py and the scrub's, which run one,
    # and test_patch_session_mutants.py (its messages, source, thread, busy writes, close).
    Module(
        "patch-session",
        "hotload_patch/session.py",
        (
            "tests/test_patch_session_mutants.py",
            *_core(
                "patcher_stages_verifies_applies_and_rolls_back",
                "the_worker_extension_patches_every_rank_over_json",
                "a_host_with_problems_is_a_kernel_format_refusal",
            ),
            *SCRUB,
        ),
        "forkserver",
    ),
    # Where each checkpoint tensor lies in an engine's parameters: test_patch_placement_mutants.py
    # (each host's refusals, messages and probe), the loader-host and identity-host tests of
    # test_patch_core.py, and the staging tests that place through them.
    Module(
        "patch-placement",
        "hotload_patch/placement.py",
        (
            "tests/test_patch_placement_mutants.py",
            "tests/test_patch_mutants.py",
            "tests/test_patch_stage_threads.py",
            *_core(
                "loader_host_follows_fused_sharded_padded_and_tied_weights",
                "loader_host_follows_views_of_the_checkpoint",
                "loader_host_refuses_loaders_that_compute_values",
                "loader_host_places_setitem_through_an_index_tensor_where_it_writes",
                "a_host_with_problems_is_a_kernel_format_refusal",
                "identity_host_refuses_unknown_and_reshaped_weights",
                "tied_names_patched_differently_are_a_weights_mismatch",
                *EVERY_RANK,
            ),
        ),
        "forkserver",
    ),
    # The staging tests of test_patch_core.py by name (the whole file's region, placement and
    # loader-host tests took most of the limit without reaching staging), the threaded staging
    # and test_patch_mutants.py.
    Module(
        "patch-staging",
        "hotload_patch/staging.py",
        (
            "tests/test_patch_mutants.py",
            "tests/test_patch_stage_threads.py",
            *(
                f"tests/test_patch_core.py::test_{name}"
                for name in (
                    "a_patch_on_every_rank_gives_what_a_full_load_of_the_child_gives"
                    "[bf16-as-f32-dense-ranges]",
                    "a_patch_on_every_rank_gives_what_a_full_load_of_the_child_gives[bf16-2ranks]",
                    "a_failed_write_puts_every_value_back",
                    "staging_keeps_old_values_only_where_the_patch_sets_them",
                    "a_float32_checkpoint_held_as_bfloat16_is_refused",
                    "a_patch_writing_nan_is_refused_on_every_rank",
                    "a_patch_for_another_snapshot_is_a_wrong_patch",
                    "a_host_with_problems_is_a_kernel_format_refusal",
                    "tied_names_patched_differently_are_a_weights_mismatch",
                    "patcher_stages_verifies_applies_and_rolls_back",
                    "a_flipped_value_in_the_patch_is_a_checksum_mismatch",
                    "a_tensor_whose_changes_are_lost_from_the_patch_is_a_checksum_mismatch",
                    "write_threads_run_on_every_cpu_of_a_pinned_process",
                )
            ),
        ),
        "forkserver",
    ),
    # The scrub thread: test_patch_scrub_mutants.py (each pass's result and record, the
    # mismatch kept until a full load, the schedule, the pace, a region re-read) and the
    # in-process tests of test_patch_scrub.py with the schedule's checks.
    Module(
        "patch-scrub",
        "hotload_patch/scrub.py",
        (
            "tests/test_patch_scrub_mutants.py",
            *SCRUB,
            "tests/test_patch_scrub.py::"
            "test_the_vllm_extension_reads_its_scrub_schedule_from_the_environment",
        ),
        "forkserver",
    ),
    # Element sizes and torch dtypes: test_patch_dtypes_mutants.py (each name's torch dtype
    # and back), the patch reader and staging (test_patch_mutants.py) and the held dtype
    # (test_patch_served_mutants.py).
    Module(
        "patch-dtypes",
        "hotload_patch/dtypes.py",
        (
            "tests/test_patch_dtypes_mutants.py",
            "tests/test_patch_mutants.py",
            "tests/test_patch_served_mutants.py",
        ),
        "forkserver",
    ),
    # The checkpoint's specs from its safetensors headers: test_patch_checkpoint_mutants.py
    # (each refusal, with its file and tensor) and the Patcher's tests, which load from a
    # checkpoint folder (test_patch_session_mutants.py).
    Module(
        "patch-checkpoint",
        "hotload_patch/checkpoint.py",
        ("tests/test_patch_checkpoint_mutants.py", "tests/test_patch_session_mutants.py"),
        "forkserver",
    ),
    # One small shard with every encoding and parent path, by the numpy path and the C kernel,
    # and each damage alone: seconds, where test_arc_codec.py + test_arc_native.py (hypothesis
    # included) took the whole limit before the first mutant.
    Module(
        "arc-decoder",
        "hotload/arc/decoder.py",
        ("tests/test_arc_decoder_mutants.py",),
        "forkserver",
    ),
    # Each field and path of one chunk (test_arc_chunk_mutants.py), small chunks decoded by
    # every path (test_arc_decoder_mutants.py), both decoders against each other
    # (test_arc_native.py), sparse_exp (test_arc_compact.py) and the changes read without the
    # parent (test_arc_patch.py): seconds a mutant, where test_arc_codec.py's round trips took
    # most of the limit.
    Module(
        "arc-chunk",
        "hotload/arc/chunk.py",
        (
            "tests/test_arc_chunk_mutants.py",
            "tests/test_arc_decoder_mutants.py",
            "tests/test_arc_native.py",
            "tests/test_arc_compact.py",
            "tests/test_arc_patch.py",
        ),
        "forkserver",
    ),
)

# mutmut's exit codes, grouped as the report counts them (mutmut.stats.status_by_exit_code).
KILLED = {1, 3, 37}
SURVIVED = {0}
TIMEOUT = {36, 24, -24, 152, 255}
NO_TESTS = {5, 33}


def prepare(module: Module, work: Path) -> str:
    """Extract HEAD into `work` with the packages at its root and write mutmut's config; return
    the commit."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit],
        check=True,
        capture_output=True,
    ).stdout
    tree = work / "tree"
    tree.mkdir()
    tar = work / "head.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as archived:
        archived.extractall(tree, filter="data")
    tar.unlink()
    # Built extensions are ignored by git, so not in the archive: the codec's C kernel
    # (hotload/arc/_native*.so, built by `make venv` from _native.c) comes from this checkout,
    # else the arc tests that require it fail mutmut's clean run.
    for built in (ROOT / "hotload").rglob("*.so"):
        shutil.copy2(built, tree / built.relative_to(ROOT))
    for source, target in PACKAGES.items():
        if source != target:
            shutil.copytree(tree / source, tree / target)
    sources = "\n    ".join(PACKAGES.values())
    tests = "\n    ".join(module.tests)
    (tree / "setup.cfg").write_text(
        "[mutmut]\n"
        f"source_paths =\n    {sources}\n"
        f"only_mutate =\n    {module.path}\n"
        f"pytest_add_cli_args_test_selection =\n    {tests}\n"
        "pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -q\n"
        "use_git_change_detection = false\n"
        f"process_isolation = {module.isolation}\n"
    )
    return commit


def sample_pattern(sample: str) -> str:
    """The mutmut name pattern of the mutants whose number ends in one of `sample`'s digits
    (every mutant when empty): a sample spread over every function, not the first ones."""
    return f"*__mutmut_*[{sample}]" if sample else "*"


def run_mutmut(tree: Path, limit: float, jobs: int, sample: str) -> int | None:
    """Run `mutmut run` in `tree` for at most `limit` seconds; return its exit status, None
    when the limit stopped it."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)  # the work tree's mutants/ must be what the tests import
    log = (tree / "mutmut-run.log").open("a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)]
        + ([sample_pattern(sample)] if sample else []),
        cwd=tree,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        # A group of its own, so that the mutants' workers (and the servers their tests
        # started) end with it: an interrupted mutmut leaves its workers running.
        start_new_session=True,
    )
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        # mutmut saves each mutant's result as it comes, so what ran before the limit counts.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def tally(tree: Path, module: Module, sample: str) -> tuple[Counter[str], list[str]]:
    """Count the module's sampled mutants by outcome from mutmut's results; return them and
    the survivors' names."""
    meta = tree / "mutants" / (module.path + ".meta")
    if not meta.is_file():
        raise SystemExit(f"mutate: {module.name}: no results in {meta}: see {tree}/mutmut-run.log")
    codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
    counts: Counter[str] = Counter()
    survivors = []
    counts["generated"] = len(codes)
    for name, code in sorted(codes.items()):
        if not fnmatch.fnmatch(name, sample_pattern(sample)):
            continue
        if code in KILLED:
            counts["killed"] += 1
        elif code in SURVIVED:
            counts["survived"] += 1
            survivors.append(name)
        elif code in TIMEOUT:
            counts["timeout"] += 1
        elif code in NO_TESTS:
            counts["no tests"] += 1
            survivors.append(name)
        elif code is None:
            counts["not checked"] += 1
        else:
            counts[f"other ({code})"] += 1
        counts["mutants"] += 1
    return counts, survivors


def main() -> int:
    """Mutate the chosen modules one after the other and print each one's score."""
    names = [m.name for m in MODULES]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", default="", help=f"comma-separated, of: {', '.join(names)}")
    parser.add_argument("--limit", type=float, default=900, help="seconds per module")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hotload-mutate"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--sample",
        default="",
        help="digits: only the mutants whose number ends in one of them (05: a fifth)",
    )
    args = parser.parse_args()
    if not args.sample.isdigit() and args.sample:
        parser.error(f"--sample: digits expected, got {args.sample!r}")
    chosen = [n.strip() for n in args.modules.split(",") if n.strip()] or names
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"--modules: unknown {unknown}; known: {', '.join(names)}")
    try:
        import mutmut  # noqa: F401
    except ImportError:
        raise SystemExit(
            "mutate: mutmut is not installed: run `make venv` (requirements/dev.txt)"
        ) from None
    for module in (m for m in MODULES if m.name in chosen):
        work = args.work / module.name
        commit = prepare(module, work)
        started = time.monotonic()
        deadline = started + args.limit
        while True:
            status = run_mutmut(work / "tree", deadline - time.monotonic(), args.jobs, args.sample)
            counts, survivors = tally(work / "tree", module, args.sample)
            finished = status is not None
            if finished and counts["not checked"] == counts["mutants"]:
                raise SystemExit(
                    f"mutate: {module.name}: mutmut exited ({status}) before checking any "
                    f"mutant (the clean test run failed?): see {work}/tree/mutmut-run.log"
                )
            if not counts["not checked"] or not finished or deadline - time.monotonic() < 30:
                break
            # Seen when the shell that started it went away: mutmut's main process ends early;
            # a rerun resumes from the results it saved.
            print(
                f"mutate: {module.name}: mutmut exited ({status}) with "
                f"{counts['not checked']} mutants unchecked: resuming",
                file=sys.stderr,
            )
        checked = counts["killed"] + counts["survived"] + counts["no tests"]
        score = 100 * counts["killed"] / checked if checked else 0.0
        print(
            f"{module.path}: {score:.1f}% killed of {checked} checked; "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            + f"; {time.monotonic() - started:.0f} s; commit {commit[:12]}; "
            + f"{datetime.now(UTC):%Y-%m-%d}"
            + (f"; sample *[{args.sample}]" if args.sample else "")
            + ("" if finished else f"; stopped at the {args.limit:.0f} s limit")
        )
        for name in survivors:
            print(f"    survived: {name}")
    print(f"mutate: the diffs: cd {args.work}/<module>/tree && mutmut show <mutant>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
