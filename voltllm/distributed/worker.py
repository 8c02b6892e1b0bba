"""A tensor- or pipeline-parallel worker process (rank 1..N-1): builds its model shard or stage and replays the steps
rank 0 sends.

It mirrors EngineCore's start-up (runner, KV cache, GEMM tuning, CUDA graphs) so that the collectives inside those
line up with rank 0's, then loops: each ("step", StepInputs) is one forward (ModelRunner.execute_follower). Pipe
messages from rank 0 (pickled tuples): ("step", StepInputs), ("fail", text) (tests: raise here), ("shutdown",).
To rank 0: ("hello",) before joining the process group, ("ready", num_blocks), ("error", text) before exiting.

It never outlives the engine: Linux's parent-death signal (SIGTERM when its parent exits), and EOF on its pipe.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import traceback
from typing import Any

logger = logging.getLogger("voltllm")


def run_worker(config: Any, rank: int, port: int, conn: Any, parent_pid: int, log_level: int) -> None:
    """Entry point of rank `rank` (multiprocessing spawn target)."""
    from voltllm.engine.engine_proc import _die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it stops us
    _die_with_parent()
    if os.getppid() != parent_pid:  # the engine died before prctl took effect
        os._exit(0)
    pp = config.parallel.pipeline_parallel_size
    who = f"tp{rank}" if pp == 1 else f"pp{rank // config.parallel.tensor_parallel_size}" + (
        f"-tp{rank % config.parallel.tensor_parallel_size}" if config.parallel.tensor_parallel_size > 1 else "")
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s {who}: %(message)s",
                        datefmt="%H:%M:%S")
    code = 0
    try:
        runner = _start(config, rank, port, conn)
        conn.send(("ready", runner.num_blocks))
        while True:
            msg = pickle.loads(conn.recv_bytes())
            if msg[0] == "step":
                runner.execute_follower(msg[1])
            elif msg[0] == "shutdown":
                break
            elif msg[0] == "fail":
                raise RuntimeError(msg[1])
    except EOFError:  # rank 0 is gone
        pass
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it in the engine
        code = 1
        logger.debug("tensor-parallel worker %d failed", rank, exc_info=True)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        except (OSError, ValueError):
            pass
    finally:
        logging.shutdown()
        os._exit(code)  # skip interpreter teardown (seconds with torch loaded): nothing here needs it


def _start(config: Any, rank: int, port: int, conn: Any):
    """Join the group, then EngineCore's start-up steps that hold collectives, in its order."""
    import torch

    from voltllm.distributed.group import TPGroup, make_store, rank_device
    from voltllm.worker.runner import ModelRunner

    size = config.parallel.world_size
    device = rank_device(config.device.device, rank)
    if device.type == "cpu":  # ranks (and data-parallel engines) share the CPU's cores (rank 0 keeps its setting)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (size * config.parallel.data_parallel_size)))
    config = dataclasses.replace(config, device=dataclasses.replace(config.device, device=device))
    conn.send(("hello",))
    tp = TPGroup(rank, size, make_store(rank, size, port), device)
    torch.manual_seed(config.parallel.global_seed(config.model.seed))  # (rank 0's: the ranks sample alike)
    runner = ModelRunner(config, tp=tp)
    runner.initialize_kv_cache()
    runner.tune_decode_gemms()
    runner.warm_up_mixed_step()
    runner.capture_cuda_graphs()
    return runner
