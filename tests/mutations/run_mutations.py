"""Mutation check: reintroduce each known defect and assert that the tests guarding it fail.

Each mutation replaces one exact snippet of the source by the defective code, in a temporary copy
of the checkout (``mineonline_core``, ``plugins``, ``tests``; put first on ``PYTHONPATH`` so the
copy shadows the editable installs), and runs only the tests named for it. A mutation whose tests
still pass is a guarantee nothing checks: the script prints it and exits 1. A snippet that is no
longer in the source is an error too, so the list cannot silently go stale.

Run: ``python tests/mutations/run_mutations.py [name ...]`` (``make test`` runs all of them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COPY = ("mineonline_core", "plugins", "tests", "conftest.py", "pyproject.toml")
PPO = "plugins/ppo/mineonline_ppo.py"
BASE = "mineonline_core/trainer/base.py"
FETCH = "mineonline_core/trainer/fetch.py"
UPDATE = "mineonline_core/trainer/update.py"
PUBLISH = "mineonline_core/trainer/publish.py"
DRIVER = "mineonline_core/trainer/driver.py"
GUARANTEES = "tests/test_guarantees.py"
PPO_TESTS = "plugins/ppo/tests/test_ppo_loss.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation("B1", "a failed auto-reset turns the terminal step into a truncation (collector)",
             "mineonline_core/rollout/collector.py", "if exc.step is not None and slot.pending_t is not None:",
             "if False:", ("tests/test_rollout_collector.py::test_a_failed_reset_after_a_terminal_keeps_the_terminal_step",)),
    Mutation("B1-envproc", "the env process answers a failed auto-reset as a failed step",
             "mineonline_core/rollout/envproc.py",
             "raise ResetFailed((float(reward), bool(terminated), bool(truncated), info, final_obs)) from exc", "raise",
             ("tests/test_rollout_collector.py::test_a_failed_reset_after_a_terminal_keeps_the_terminal_step",)),
    Mutation("B2", "a resumed run restarts stream incarnations at 0", "mineonline_core/rollout/manager.py",
             "return self._first_incarnation.get(worker_id, 0) + restarts, latest", "return restarts, latest",
             ("plugins/lmdb_buffer/tests/test_resume_streams.py::test_resumed_streams_never_reuse_stored_keys",)),
    Mutation("B3", "the KL reference starts each chunk from the trained policy's state", UPDATE,
             "ref_state = tree_index(batch[F.REF_STATE_IN], rows) if batch.get(F.REF_STATE_IN) is not None else None",
             "ref_state = state",
             (f"{GUARANTEES}::test_drifted_reference_carries_its_own_state_from_each_episode_start",)),
    Mutation("5.4", "the KL reference starts each chunk from initial_state", UPDATE,
             "ref_state = tree_index(batch[F.REF_STATE_IN], rows) if batch.get(F.REF_STATE_IN) is not None else None",
             "ref_state = self.reference.initial_state(len(rows))",
             (f"{GUARANTEES}::test_drifted_reference_carries_its_own_state_from_each_episode_start",)),
    Mutation("B4", "normalize_advantage_full_batch: false normalises each micro-batch", PPO,
             "if self.options.normalize_advantage_per_minibatch:", "if not self.options.normalize_advantage_full_batch:",
             (f"{PPO_TESTS}::test_normalize_advantage_full_batch_false_leaves_advantages_alone",)),
    Mutation("B5", "resume keeps the checkpoint's optimiser hyperparameters", BASE,
             "self.apply_optimizer_settings(self.optimizer, self.iteration + 1)", "pass",
             ("tests/test_trainer_resume.py::test_resume_applies_the_configs_optimiser_settings",)),
    Mutation("B6", "prefetch_batches is read by nothing (fetch-ahead depth fixed at 1)", FETCH,
             "min(self.iteration + tc.prefetch_batches, tc.num_iterations)", "min(self.iteration + 1, tc.num_iterations)",
             ("tests/test_trainer_prefetch.py::test_prefetch_batches_is_the_fetch_ahead_depth",)),
    Mutation("5.1", "the 'old' log-probs are recomputed with the current model", PPO,
             "behaviour_logprob=batch[F.LOGPROB],",
             "behaviour_logprob=self.policy.pi_head.logprob(batch[F.ACTION], outputs['pi_logits']).detach(),",
             (f"{GUARANTEES}::test_stale_data_ratio_is_taken_against_the_stored_behaviour_logprob",)),
    Mutation("5.3-carry", "training windows do not carry the recurrent state", UPDATE,
             "            state = detach_state(state_out)\n", "            state = tree_index(batch[F.STATE_IN], rows)\n",
             (f"{GUARANTEES}::test_first_step_on_version0_data_is_on_policy_and_kl_to_an_identical_reference_is_0[gru]",)),
    Mutation("5.3-rows", "each micro-batch starts from the first chunks' state_in rows", UPDATE,
             "        state = tree_index(batch[F.STATE_IN], rows)\n",
             "        state = tree_index(batch[F.STATE_IN], slice(0, len(rows)))\n",
             (f"{GUARANTEES}::test_first_step_on_version0_data_is_on_policy_and_kl_to_an_identical_reference_is_0[gru]",)),
    Mutation("shuffle", "the same minibatches in buffer order every epoch", UPDATE,
             "order = torch.randperm(n, device=device)", "order = torch.arange(n, device=device)",
             (f"{PPO_TESTS}::test_minibatches_are_reshuffled_every_epoch",)),
    Mutation("checksum", "fragment checksums are not verified on read", FETCH,
             "if fragment_checksum(key, frag) != crc]", "if False]",
             ("tests/test_trainer_prefetch.py::test_a_fragment_whose_checksum_does_not_match_is_dropped_and_counted",)),
    Mutation("resume-staleness", "the first fetch after a resume is judged at the buffer's version 0", FETCH,
             "batch = self.fetch_chunks(num_chunks, self.version)", "batch = self.fetch_chunks(num_chunks)",
             ("tests/test_trainer_prefetch.py::test_the_first_fetch_after_a_resume_honours_max_staleness",)),
    Mutation("broadcast-live", "the broadcast thread sends the live weights, not the snapshot", PUBLISH,
             "            refs = [self._put_weights(weights.host())]",
             "            refs = [self._put_weights(weights.copy_from(unwrap(self.model).state_dict()).host())]",
             ("tests/test_trainer_broadcast.py::test_versions_arrive_in_order_with_the_weights_they_were_published_with",)),
    Mutation("broadcast-silent", "a failed broadcast is not raised by the next iteration", BASE,
             "        self.check_broadcast()  # the previous", "        pass  # the previous",
             ("tests/test_trainer_broadcast.py::test_a_failed_broadcast_surfaces_on_the_next_iteration_with_its_cause",)),
    Mutation("gpu-ray-train", "one GPU rank always goes to Ray Train", DRIVER,
             "        return tc.num_workers > 1\n", "        return tc.num_workers > 1 or tc.num_gpus_per_worker > 0\n",
             ("tests/test_trainer_device.py::test_the_lease_holds_the_ranks_gpu_share_and_a_driver_without_cuda_hands_it_to_ray_train",)),
)


def copy_checkout(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".venv")
    for name in COPY:
        src = ROOT / name
        (shutil.copytree(src, dest / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, dest / name))


def run(mutation: Mutation, timeout: float) -> tuple[Mutation, str, float, str]:
    """Returns (mutation, "caught" | "MISSED" | "ERROR", seconds, output tail)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as tmp:
        dest = Path(tmp)
        copy_checkout(dest)
        target = dest / mutation.path
        source = target.read_text()
        if source.count(mutation.old) != 1:
            return mutation, "ERROR", 0.0, f"{mutation.path}: the snippet occurs {source.count(mutation.old)} times, not once"
        target.write_text(source.replace(mutation.old, mutation.new))
        paths = [dest, *(p for p in (dest / "plugins").iterdir() if p.is_dir())]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths)), "WANDB_MODE": "disabled"}
        check = f"import mineonline_core, mineonline_ppo; assert mineonline_core.__file__.startswith({str(dest)!r}) and mineonline_ppo.__file__.startswith({str(dest)!r})"
        shadow = subprocess.run([sys.executable, "-c", check], cwd=dest, env=env, capture_output=True, text=True)
        if shadow.returncode:
            return mutation, "ERROR", 0.0, "the copy does not shadow the installed packages:\n" + shadow.stderr[-2000:]
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", *mutation.tests]
        try:
            proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return mutation, "caught", time.monotonic() - start, "timed out (the tests hung on the defect)"
        output = (proc.stdout + proc.stderr)[-3000:]
        if proc.returncode == 1:
            return mutation, "caught", time.monotonic() - start, output
        if proc.returncode == 0:
            return mutation, "MISSED", time.monotonic() - start, output
        return mutation, "ERROR", time.monotonic() - start, f"pytest exit code {proc.returncode}:\n{output}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="mutations run at once")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutation's tests")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutations {unknown}; known: {sorted(known)}")
    chosen = [known[n] for n in args.names] or list(MUTATIONS)
    start = time.monotonic()
    failed = 0
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for mutation, verdict, seconds, output in pool.map(lambda m: run(m, args.timeout), chosen):
            print(f"{verdict:7s} {mutation.name:17s} {seconds:6.1f}s  {mutation.what}", flush=True)
            if verdict != "caught":
                failed += 1
                print("        " + output.replace("\n", "\n        "), flush=True)
    print(f"{len(chosen) - failed}/{len(chosen)} defects caught in {time.monotonic() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
