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
COPY = ("mineonline_core", "plugins", "tests", "examples", "conftest.py", "pyproject.toml")
PPO = "plugins/ppo/mineonline_ppo.py"
BASE = "mineonline_core/trainer/base.py"
FETCH = "mineonline_core/trainer/fetch.py"
UPDATE = "mineonline_core/trainer/update.py"
PUBLISH = "mineonline_core/trainer/publish.py"
DRIVER = "mineonline_core/trainer/driver.py"
GUARANTEES = "tests/test_guarantees.py"
EVALUATION = "mineonline_core/trainer/evaluation.py"
EVAL_TESTS = "tests/test_eval_while_training.py"
TRIAL = "mineonline_core/driver/trial.py"
PPO_TESTS = "plugins/ppo/tests/test_ppo_loss.py"
BUFFER = "mineonline_core/rollout/buffer.py"
COLLECTOR = "mineonline_core/rollout/collector.py"
GAE = "mineonline_core/trainer/gae.py"
VPT_NET = "plugins/vpt_policy/mineonline_vpt/network.py"
BUFFER_TESTS = "tests/test_buffer.py"
GAE_TESTS = "tests/test_gae.py"
VPT_STEPWISE = (
    "plugins/vpt_policy/tests/test_policy.py::test_stepwise_rollout_equals_chunked_training_forward[0-dtype0-1e-09]"
)
COLLECTOR_BOOTSTRAP = (
    "tests/test_rollout_collector.py::test_recurrent_state_and_truncation_bootstrap_reproduce_rollout[inline]"
)


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "B1",
        "a failed auto-reset turns the terminal step into a truncation (env pool)",
        "mineonline_core/rollout/envpool.py",
        "if exc.step is not None and slot.stepping:",
        "if False:",
        ("tests/test_rollout_collector.py::test_a_failed_reset_after_a_terminal_keeps_the_terminal_step",),
    ),
    Mutation(
        "B1-envproc",
        "the env process answers a failed auto-reset as a failed step",
        "mineonline_core/rollout/envproc.py",
        "raise ResetFailed((float(reward), bool(terminated), bool(truncated), info, final_obs)) from exc",
        "raise",
        ("tests/test_rollout_collector.py::test_a_failed_reset_after_a_terminal_keeps_the_terminal_step",),
    ),
    Mutation(
        "B2",
        "a resumed run restarts stream incarnations at 0",
        "mineonline_core/rollout/manager.py",
        "return self._first_incarnation.get(worker_id, 0) + restarts, latest",
        "return restarts, latest",
        ("plugins/lmdb_buffer/tests/test_resume_streams.py::test_resumed_streams_never_reuse_stored_keys",),
    ),
    Mutation(
        "B3",
        "the KL reference starts each chunk from the trained policy's state",
        UPDATE,
        "ref_state = tree_index(batch[F.REF_STATE_IN], rows) if batch.get(F.REF_STATE_IN) is not None else None",
        "ref_state = state",
        (f"{GUARANTEES}::test_drifted_reference_carries_its_own_state_from_each_episode_start",),
    ),
    Mutation(
        "5.4",
        "the KL reference starts each chunk from initial_state",
        UPDATE,
        "ref_state = tree_index(batch[F.REF_STATE_IN], rows) if batch.get(F.REF_STATE_IN) is not None else None",
        "ref_state = self.reference.initial_state(len(rows))",
        (f"{GUARANTEES}::test_drifted_reference_carries_its_own_state_from_each_episode_start",),
    ),
    Mutation(
        "B4",
        "normalize_advantage_full_batch: false normalises each micro-batch",
        PPO,
        "if self.options.normalize_advantage_per_minibatch:",
        "if not self.options.normalize_advantage_full_batch:",
        (f"{PPO_TESTS}::test_normalize_advantage_full_batch_false_leaves_advantages_alone",),
    ),
    Mutation(
        "B5",
        "resume keeps the checkpoint's optimiser hyperparameters",
        BASE,
        "self.apply_optimizer_settings(self.optimizer, self.iteration + 1)",
        "pass",
        ("tests/test_trainer_resume.py::test_resume_applies_the_configs_optimiser_settings",),
    ),
    Mutation(
        "B6",
        "prefetch_batches is read by nothing (fetch-ahead depth fixed at 1)",
        FETCH,
        "min(self.iteration + tc.prefetch_batches, tc.num_iterations)",
        "min(self.iteration + 1, tc.num_iterations)",
        ("tests/test_trainer_prefetch.py::test_prefetch_batches_is_the_fetch_ahead_depth",),
    ),
    Mutation(
        "5.1",
        "MineStudio's defect: the stored behaviour log-probs are overwritten by the current model's at fetch time",
        "mineonline_core/trainer/batch.py",
        '    batch[F.LOGPROB_PROX], batch[F.OLD_VPRED] = current["logprob"], current["vpred"]\n',
        '    batch[F.LOGPROB] = current["logprob"]\n    batch[F.LOGPROB_PROX], batch[F.OLD_VPRED] = current["logprob"], current["vpred"]\n',
        (
            f"{GUARANTEES}::test_stale_data_ratio_is_taken_against_the_stored_behaviour_logprob",
            f"{GUARANTEES}::test_the_stored_behaviour_logprob_changes_the_update",
        ),
    ),
    Mutation(
        "5.1-window",
        "the 'old' log-probs are recomputed with the current model in every window",
        PPO,
        "behaviour_logprob=batch[F.LOGPROB],",
        "behaviour_logprob=self.policy.pi_head.logprob(batch[F.ACTION], outputs['pi_logits']).detach(),",
        (f"{GUARANTEES}::test_stale_data_ratio_is_taken_against_the_stored_behaviour_logprob",),
    ),
    Mutation(
        "surrogate-min",
        "the clipped surrogate without its min (optimistic outside the clip range)",
        PPO,
        "surrogate = weight * torch.min(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)",
        "surrogate = weight * ratio.clamp(1 - clip, 1 + clip) * advantage",
        (f"{PPO_TESTS}::test_the_surrogate_is_pessimistic_outside_the_clip_range",),
    ),
    Mutation(
        "vf-raw-returns",
        "the normalised value head regresses raw returns",
        UPDATE,
        "batch[F.VALUE_TARGET] = normalize(batch[F.RETURN]).float()",
        "batch[F.VALUE_TARGET] = batch[F.RETURN].float()",
        (f"{GUARANTEES}::test_the_normalised_value_head_regresses_normalised_returns",),
    ),
    Mutation(
        "vclip-updated",
        "clip_vloss centred on the stored value under the updated normaliser",
        UPDATE,
        "            batch[F.VALUE_TARGET] = normalize(batch[F.RETURN]).float()\n",
        "            batch[F.VALUE_TARGET] = normalize(batch[F.RETURN]).float()\n            batch[F.OLD_VPRED] = normalize(batch[F.VPRED]).float()\n",
        (f"{GUARANTEES}::test_clip_vloss_is_centred_on_the_value_heads_output_at_the_start_of_the_update",),
    ),
    Mutation(
        "vclip-denorm",
        "clip_vloss centred on the value in denormalised units",
        PPO,
        "old_vpred=batch[F.OLD_VPRED],",
        "old_vpred=batch[F.VALUE],",
        (f"{GUARANTEES}::test_clip_vloss_is_centred_on_the_value_heads_output_at_the_start_of_the_update",),
    ),
    Mutation(
        "5.3-carry",
        "training windows do not carry the recurrent state",
        UPDATE,
        "            state = detach_state(state_out)\n",
        "            state = tree_index(batch[F.STATE_IN], rows)\n",
        (f"{GUARANTEES}::test_first_step_on_version0_data_is_on_policy_and_kl_to_an_identical_reference_is_0[gru]",),
    ),
    Mutation(
        "5.3-rows",
        "each micro-batch starts from the first chunks' state_in rows",
        UPDATE,
        "        state = tree_index(batch[F.STATE_IN], rows)\n",
        "        state = tree_index(batch[F.STATE_IN], slice(0, len(rows)))\n",
        (f"{GUARANTEES}::test_first_step_on_version0_data_is_on_policy_and_kl_to_an_identical_reference_is_0[gru]",),
    ),
    Mutation(
        "shuffle",
        "the same minibatches in buffer order every epoch",
        UPDATE,
        "order = torch.randperm(n, device=device)",
        "order = torch.arange(n, device=device)",
        (f"{PPO_TESTS}::test_minibatches_are_reshuffled_every_epoch",),
    ),
    Mutation(
        "checksum",
        "fragment checksums are not verified on read",
        FETCH,
        "if fragment_checksum(key, frag) != crc\n",
        "if False\n",
        ("tests/test_trainer_prefetch.py::test_a_fragment_whose_checksum_does_not_match_is_dropped_and_counted",),
    ),
    Mutation(
        "resume-staleness",
        "the first fetch after a resume is judged at the buffer's version 0",
        FETCH,
        "batch = self.fetch_chunks(num_chunks, self.version)",
        "batch = self.fetch_chunks(num_chunks)",
        ("tests/test_trainer_prefetch.py::test_the_first_fetch_after_a_resume_honours_max_staleness",),
    ),
    Mutation(
        "chunk-staleness",
        "a chunk's staleness is judged by its newest fragment",
        BUFFER,
        'version=min(int(m["version"]) for m in metas),',
        'version=max(int(m["version"]) for m in metas),',
        (f"{BUFFER_TESTS}::test_a_chunk_is_as_old_as_its_oldest_fragment",),
    ),
    Mutation(
        "frag-staleness",
        "a fragment's staleness is judged by its newest step",
        "mineonline_core/contracts/fragment.py",
        '"version": int(np.min(fragment[VERSION])),',
        '"version": int(np.max(fragment[VERSION])),',
        (f"{BUFFER_TESTS}::test_a_fragment_is_as_old_as_its_oldest_step",),
    ),
    Mutation(
        "gae-trunc-zero",
        "GAE treats a truncation as a terminal (bootstraps nothing)",
        GAE,
        "following = torch.where(terminated, torch.zeros_like(following), following)",
        "following = torch.where(terminated | truncated, torch.zeros_like(following), following)",
        (f"{GAE_TESTS}::test_truncation_bootstraps_from_the_stored_value_and_restarts",),
    ),
    Mutation(
        "gae-trunc-carry",
        "GAE carries the trace through a truncation into the next episode",
        GAE,
        "carry = (~(terminated | truncated)).float()",
        "carry = (~terminated).float()",
        (f"{GAE_TESTS}::test_truncation_bootstraps_from_the_stored_value_and_restarts",),
    ),
    Mutation(
        "gae-normalized",
        "GAE runs on the value head's normalised values",
        "mineonline_core/trainer/batch.py",
        '"value": denormalized_value(policy, vpred).float(),',
        '"value": vpred.float(),',
        ("tests/test_trainer_sequence.py::test_forward_reproduces_behaviour[mlp]",),
    ),
    Mutation(
        "bootstrap-initial",
        "a truncation bootstraps from the initial recurrent state",
        COLLECTOR,
        "row = tree_map(lambda s: s[slot.env_id : slot.env_id + 1].clone(), self.state)",
        "row = tree_map(lambda s: s.clone(), self._init_row)",
        (COLLECTOR_BOOTSTRAP,),
    ),
    Mutation(
        "bootstrap-first",
        "a truncation bootstraps with first=True (the policy resets its state)",
        COLLECTOR,
        "+ [[False]] * len(values)",
        "+ [[True]] * len(values)",
        (COLLECTOR_BOOTSTRAP,),
    ),
    Mutation(
        "kl-direction",
        "the KL penalty is KL(ref || pi) instead of KL(pi || ref)",
        PPO,
        "pi_head.kl_divergence(pi_logits, ref_logits)",
        "pi_head.kl_divergence(ref_logits, pi_logits)",
        (
            f"{PPO_TESTS}::test_kl_term_is_weighted_by_rho",
            f"{GUARANTEES}::test_drifted_reference_carries_its_own_state_from_each_episode_start",
        ),
    ),
    Mutation(
        "ref-state-after",
        "rollout records the reference's state after the fragment's first step",
        COLLECTOR,
        "        ref_np = to_numpy(ref_sel)\n",
        "        ref_np = to_numpy(ref_out)\n",
        ("tests/test_rollout_ray.py::test_worker_records_the_reference_policys_own_state_at_each_fragment_start",),
    ),
    Mutation(
        "vpt-first-t0",
        "VPT honours first only at a call's first step",
        VPT_NET,
        "episode = first.long().cumsum(1)",
        "episode = first[:, :1].long().expand(b, t)",
        (VPT_STEPWISE,),
    ),
    Mutation(
        "vpt-mask-state",
        "VPT's attention sees the state's memory across an episode start",
        VPT_NET,
        "state_ok = state_mask.expand(b, t, maxlen) & fresh[:, :, None]",
        "state_ok = state_mask.expand(b, t, maxlen)",
        ("plugins/vpt_policy/tests/test_conformance.py::TestVPTPolicy::test_an_episode_start_forgets_the_state_in",),
    ),
    Mutation(
        "vpt-mask-frames",
        "VPT's attention sees a call's frames of the previous episode",
        VPT_NET,
        "frame_ok = episode[:, :, None] == episode[:, None, :]",
        "frame_ok = episode[:, :, None] >= episode[:, None, :]",
        (VPT_STEPWISE,),
    ),
    Mutation(
        "vtrace-cbar",
        "V-trace truncates the traces c with rho-bar instead of c-bar",
        "plugins/vtrace/mineonline_vtrace.py",
        "ratio.clamp(max=rho_bar), ratio.clamp(max=c_bar)",
        "ratio.clamp(max=rho_bar), ratio.clamp(max=rho_bar)",
        ("plugins/vtrace/tests/test_vtrace_math.py::test_recursion_matches_the_sum_of_eq_1[0-2.0-0.5]",),
    ),
    Mutation(
        "accum-scale",
        "gradient accumulation sums the micro-batches' gradients (no 1/k)",
        UPDATE,
        "scale=1.0 / min(accum, num_batches - group_start)",
        "scale=1.0",
        (f"{PPO_TESTS}::test_gradient_accumulation_matches_one_big_batch",),
    ),
    Mutation(
        "env-steps",
        "rollout/env_steps restarts at 0 after a resume (the manager's own tally)",
        "mineonline_core/rollout/manager.py",
        'out["rollout/env_steps"] = self._read_env_steps()',
        'out["rollout/env_steps"] = sums.get("rollout/env_steps", 0.0)',
        ("tests/test_resume_safety.py::test_resume_from_a_chosen_checkpoint_with_force",),
    ),
    Mutation(
        "ranks-share",
        "DDP ranks of one iteration are served the same freshest chunks",
        BUFFER,
        "eligible.sort(key=lambda c: (round_id in c.rounds, -c.version, c.reuse, c.seq))",
        "eligible.sort(key=lambda c: (-c.version, c.reuse, c.seq))",
        (f"{BUFFER_TESTS}::test_ranks_of_one_round_get_disjoint_chunks_while_enough_unserved_are_eligible",),
    ),
    Mutation(
        "prefetch-round",
        "a fetch ahead is filed under the current iteration's round",
        FETCH,
        "self._fetch_in_background(num_chunks, self.version + bumps, iteration)",
        "self._fetch_in_background(num_chunks, self.version + bumps, self.iteration)",
        (
            "tests/test_trainer_prefetch.py::test_each_fetch_names_the_iteration_it_is_for_so_ranks_of_one_iteration_get_disjoint_chunks",
        ),
    ),
    Mutation(
        "nonfinite-rank",
        "each rank decides alone to skip a non-finite step",
        UPDATE,
        "        if self.distributed():\n            flag = torch.tensor([1.0 if finite else 0.0], device=self.device)",
        "        if False:\n            flag = torch.tensor([1.0 if finite else 0.0], device=self.device)",
        ("tests/test_trainer_ddp.py::test_a_non_finite_loss_on_one_rank_skips_that_step_on_every_rank",),
    ),
    Mutation(
        "adv-per-rank",
        "advantages are normalised with each rank's own statistics",
        UPDATE,
        "            dist.all_reduce(sums)\n",
        "            pass\n",
        ("tests/test_trainer_ddp.py::test_two_ranks_equal_one_rank",),
    ),
    Mutation(
        "broadcast-live",
        "the broadcast thread sends the live weights, not the snapshot",
        PUBLISH,
        "            refs = [self._put_weights(weights.host())]",
        "            refs = [self._put_weights(weights.copy_from(unwrap(self.model).state_dict()).host())]",
        ("tests/test_trainer_broadcast.py::test_versions_arrive_in_order_with_the_weights_they_were_published_with",),
    ),
    Mutation(
        "broadcast-silent",
        "a failed broadcast is not raised by the next iteration",
        BASE,
        "        self.check_broadcast()  # the previous",
        "        pass  # the previous",
        ("tests/test_trainer_broadcast.py::test_a_failed_broadcast_surfaces_on_the_next_iteration_with_its_cause",),
    ),
    Mutation(
        "gpu-ray-train",
        "one GPU rank always goes to Ray Train",
        DRIVER,
        "        return tc.num_workers > 1\n",
        "        return tc.num_workers > 1 or tc.num_gpus_per_worker > 0\n",
        (
            "tests/test_trainer_device.py::test_the_lease_holds_the_ranks_gpu_share_and_a_driver_without_cuda_hands_it_to_ray_train",
        ),
    ),
    Mutation(
        "ckpt-unsafe-resume",
        "a checkpoint file that runs code is not refused before Ray (weights_only check left out)",
        "mineonline_core/driver/resume.py",
        "        ckpt.check_loads_safely(verified)  # a file",
        "        pass  # a file",
        (
            "tests/faults/test_checkpoint_faults.py::test_a_checkpoint_file_that_runs_code_is_refused_before_ray_naming_it[model.pt]",
        ),
    ),
    Mutation(
        "ckpt-stale-live",
        "the stale-temporary cleanup deletes a live writer's checkpoint in progress",
        "mineonline_core/trainer/checkpoint.py",
        "        if not _alive(int(match.group(1))):",
        "        if True:",
        (
            "tests/faults/test_checkpoint_faults.py::test_stale_temporary_checkpoints_of_dead_writers_are_removed_and_live_ones_spared",
        ),
    ),
    Mutation(
        "store-unverified",
        "a resumed LMDB store is opened without verifying its shards (issue 28)",
        "plugins/lmdb_buffer/mineonline_lmdb/store.py",
        "        damaged = verify_shards(present)\n",
        "        damaged = []\n",
        ("plugins/lmdb_buffer/tests/test_damage.py::test_a_damaged_shard_is_refused_naming_it_and_the_way_out",),
    ),
    Mutation(
        "rank-node-lost",
        "a rank lost with its node fails the run instead of restarting (issue 28)",
        "mineonline_core/trainer/recovery.py",
        'if isinstance(getattr(err, "health_check_failure", None), ray.exceptions.RayActorError):',
        "if False:",
        ("tests/faults/test_cluster_faults.py::test_a_rank_lost_with_its_node_counts_as_a_dead_rank",),
    ),
    Mutation(
        "placement-per-node",
        "only the cluster's sum is checked: a rank that fits no node waits (issue 28)",
        "mineonline_core/driver/api.py",
        "        check_placement(cfg, ray.nodes(), address)",
        "        pass",
        ("tests/faults/test_cluster_faults.py::test_a_rank_that_fits_no_node_is_refused_before_training",),
    ),
    Mutation(
        "hang-batch",
        "a late (frozen) env holds its worker's whole batch until step_timeout",
        "mineonline_core/rollout/envpool.py",
        "return [s.sent_at + late_after for s in busy if s.sent_at + late_after > now]",
        "return [s.sent_at + late_after for s in busy]",
        ("tests/faults/test_hangs.py::test_one_frozen_env_of_four_does_not_hold_the_others",),
    ),
    Mutation(
        "hang-worker",
        "a rollout worker silent past hang_timeout is named but never killed",
        "mineonline_core/rollout/supervision.py",
        "ray.kill(self._workers[i], no_restart=False)",
        "pass",
        ("tests/faults/test_hangs.py::test_frozen_rollout_worker_is_named_killed_and_restarted",),
    ),
    Mutation(
        "eval-blocks",
        "training waits for the running evaluation instead of skipping the next one",
        EVALUATION,
        "ready, _ = ray.wait([ref], timeout=None if wait else 0)",
        "ready, _ = ray.wait([ref], timeout=None)",
        (f"{EVAL_TESTS}::test_evaluation_never_blocks_training",),
    ),
    Mutation(
        "eval-best-live",
        "keep_best by eval keeps the weights of the iteration judged, not of the one evaluated",
        EVALUATION,
        "        os.replace(candidate, kept)\n",
        "        kept = self._write_checkpoint(root, keep_interval=None)\n",
        (f"{EVAL_TESTS}::test_evaluation_never_blocks_training",),
    ),
    Mutation(
        "trainer-switch",
        "another installed trainer's train_config keys are not set aside (trainer_name=... fails)",
        "mineonline_core/driver/resolve.py",
        "    warning = set_aside_foreign_keys(trainer_cls, loaded.config.train_config, trainers)",
        "    warning = None",
        ("tests/test_trainer_switch.py",),
    ),
    Mutation(
        "progress-steps",
        "the progress bar and ETA follow num_iterations when max_env_steps ends the run",
        "mineonline_core/driver/progress.py",
        "        return self.num_iterations <= 0 or steps > self.iteration() / self.num_iterations",
        "        return False",
        ("tests/test_logging_console.py::test_progress_follows_max_env_steps_when_it_ends_the_run",),
    ),
    Mutation(
        "tune-resume-fresh",
        "a resumed tune trial starts its run anew instead of continuing its checkpoint",
        TRIAL,
        "            elif has_checkpoint:",
        "            elif False:",
        ("tests/test_tune.py::test_an_interrupted_experiment_resumes",),
    ),
    Mutation(
        "tune-stop-ignored",
        "a trial that ASHA stops goes on training to the end",
        TRIAL,
        "        return self._stop.is_set()",
        "        return False",
        ("tests/test_tune.py::test_asha_sweep_of_two_learning_rates_by_two_seeds",),
    ),
    Mutation(
        "arch-upward",
        "a rollout module imports the driver (an import up a floor)",
        "mineonline_core/rollout/worker.py",
        "from mineonline_core.rollout.fragbuild import Timers\n",
        "from mineonline_core.rollout.fragbuild import Timers\nfrom mineonline_core.driver import rundir\n",
        ("tests/test_architecture.py::test_no_import_runs_up_a_floor",),
    ),
    Mutation(
        "arch-cycle",
        "two rollout modules import each other at module level",
        "mineonline_core/rollout/fragbuild.py",
        "from mineonline_core.contracts.tree import tree_map\n",
        "from mineonline_core.contracts.tree import tree_map\nfrom mineonline_core.rollout import worker\n",
        ("tests/test_architecture.py::test_no_import_cycles_in_the_core",),
    ),
    Mutation(
        "stream-parse",
        "the one stream-name parser swaps worker id and incarnation (a resume reuses stored keys)",
        "mineonline_core/contracts/fragment.py",
        "    worker_id, incarnation, env_id = (int(part) for part in parts)",
        "    incarnation, worker_id, env_id = (int(part) for part in parts)",
        (
            "tests/test_fragment_keys.py",
            "plugins/lmdb_buffer/tests/test_resume_streams.py::test_first_free_incarnations",
        ),
    ),
    Mutation(
        "options-section",
        "the one options validator forgets which section a component's bad key sits in",
        "mineonline_core/config/messages.py",
        '    prefix: Loc = tuple(section.split("."))',
        "    prefix: Loc = ()",
        ("tests/test_trainer_switch.py",),
    ),
    Mutation(
        "handles-stale",
        "a typed handle names a method its actor does not have (services/handles.py goes stale)",
        "mineonline_core/services/handles.py",
        "    def stop_requested(self) -> bool: ...",
        "    def stop_was_requested(self) -> bool: ...",
        ("tests/test_handles.py::test_each_method_exists_on_the_actor_with_its_parameters[RolloutManagerHandle]",),
    ),
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
            return (
                mutation,
                "ERROR",
                0.0,
                f"{mutation.path}: the snippet occurs {source.count(mutation.old)} times, not once",
            )
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
