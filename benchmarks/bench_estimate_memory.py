"""Peak memory of the estimate / proximal pass (``trainer/batch.py`` ``current_policy_outputs``) as a
ratio of one window's activations: issue 33's target is at most 1.1x (it was 2.0x while the previous
window's graph outlived its turn).

The pass runs with autograd on (some kernels compute otherwise without it), so what a window costs is
the graph its forward records: the tensors autograd saves for backward. ``GraphTracker``
(``mineonline_core/testing/graphs.py``) tags each saved tensor with the forward call that saved it and
adds its bytes while it is alive (``saved_tensors_hooks``; a saved tensor dies with its graph). The
figure printed, ``peak_saved_bytes / window_saved_bytes``, is then the most activation memory the pass
held at once over the largest one window's forward holds: 1.0 means each window's graph is gone before
the next one runs. It is the quantity that scales to a GPU (107 MiB a frame for the flagship's CNN in
fp32), where the CPU allocator cannot report peaks. The network is the core's recurrent CNN on 64x64
images, chunks of ``--length`` steps in windows of ``--context``. Prints ONE JSON line.

    python benchmarks/bench_estimate_memory.py
    python benchmarks/bench_estimate_memory.py --chunks 4 --length 64 --context 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

import torch  # noqa: E402

from mineonline_core.testing.graphs import GraphTracker  # noqa: E402
from mineonline_core.testing.kit import TinyImageEnv, chunks_of, cnn_policy, rollout_fragments  # noqa: E402
from mineonline_core.trainer.batch import assemble_chunks, current_policy_outputs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4, help="chunks in the batch (one micro-batch)")
    parser.add_argument("--length", type=int, default=64, help="steps per chunk")
    parser.add_argument("--context", type=int, default=16, help="context_length: steps per window")
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = cnn_policy()
    streams = rollout_fragments(
        policy, lambda i: TinyImageEnv(seed=i), num_envs=args.chunks, fragment_length=args.length, fragments_per_env=1
    )
    batch = assemble_chunks(chunks_of(streams, 1))
    start = time.perf_counter()
    with GraphTracker(policy) as tracker:
        current_policy_outputs(policy, batch, context_length=args.context, batch_size=args.chunks)
    frames = args.chunks * args.context
    print(
        json.dumps(
            {
                "bench": "estimate_memory",
                "policy": "RecurrentCNNPolicy 64x64, channels 8/16/16, GRU 32",
                "chunks": args.chunks,
                "steps_per_chunk": args.length,
                "context_length": args.context,
                "window_saved_bytes": tracker.window_bytes,
                "saved_bytes_per_frame": tracker.window_bytes // frames,
                "peak_saved_bytes": tracker.peak_bytes,
                "peak_over_one_window": round(tracker.peak_bytes / tracker.window_bytes, 3),
                "most_graphs_alive": tracker.max_calls_alive,
                "target": "<= 1.1",
                "seconds": round(time.perf_counter() - start, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
