"""One tensor-parallel rank: joins the torch.distributed group, builds its ModelRunner (its shard of the model,
its own KV cache) and serves the engine's messages in order. A step runs `collect(launch(step))` at once, so the
runner's state never holds in-flight placeholders; rank 0 answers with the RunnerOutput.

Started as `python -m kestrel.executor.worker` by the mp executor, or inside a Ray actor (ray_executor.py)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

import zmq

from kestrel.core.supervisor import die_with_parent, parent_gone, wait_while_parent_lives
from kestrel.executor import messages as M

logger = logging.getLogger("kestrel.worker")

POLL_MS = 1000  # how often an idle worker checks that its engine is still alive


def worker_device(config, local_index: int):
    import torch

    from kestrel.core.device import pick_device

    device = pick_device(config.model.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_index)
        torch.cuda.set_device(device)
    return device


def run_worker(config_dict: dict, rank: int, size: int, init_method: str, input_addr: str, output_addr: str,
               local_index: int | None = None, parent_pid: int | None = None) -> None:
    """Serve the engine until it sends shutdown or goes away; any error is reported (naming this rank), then the
    worker exits."""
    import torch

    from kestrel.config import EngineConfig
    from kestrel.distributed import init_distributed

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(output_addr)
    me = str(rank).encode()
    try:
        config = EngineConfig.from_dict(config_dict)
        device = worker_device(config, rank if local_index is None else local_index)
        if device.type == "cpu":
            torch.set_num_threads(config.parallel.cpu_threads or max(1, (os.cpu_count() or 1) // size))
        parallel = init_distributed(rank, size, init_method, device)
        from kestrel.executor.runner_build import build_runner

        runner = build_runner(config, progress=False, parallel=parallel)
        logger.info("tensor-parallel worker rank %d ready (pid %d)", rank, os.getpid())
        _serve(runner, rank, inp, out, me, parent_pid)
        torch.distributed.destroy_process_group()  # a clean exit (after a peer's failure the engine kills us)
    except BaseException as e:
        logger.error("tensor-parallel worker rank %d failed: %s\n%s", rank, e, traceback.format_exc())
        out.send_multipart([me, M.ERR, M.encoder.encode(f"{type(e).__name__}: {e}")])
        raise SystemExit(1)
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()


def min_over_ranks(num_blocks: int) -> int:
    """start_up's `agree`: the KV blocks every rank can hold (each rank profiled its own memory)."""
    import torch
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    n = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    agreed = int(n.item())
    if agreed != num_blocks:
        logger.info("KV blocks: this rank fits %d, the ranks agree on %d", num_blocks, agreed)
    return agreed


def _serve(runner, rank: int, inp: zmq.Socket, out: zmq.Socket, me: bytes, parent_pid: int | None) -> None:
    import numpy as np
    import torch

    from kestrel.structured_output.bitmask import StepBitmask

    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    while True:
        if not wait_while_parent_lives(poller.poll, parent_pid, POLL_MS):
            logger.warning("engine process %d is gone; worker rank %d exits", parent_pid, rank)
            return
        frames = inp.recv_multipart()
        method, payload = frames[0], frames[1]
        if method == M.STEP:
            if len(frames) > 2:  # a grammar bitmask (masks, their rows): forward, mask the logits, sample
                inf = runner.launch(M.step_decoder.decode(payload), sample=False)
                rows = np.frombuffer(frames[3], dtype=np.int32).tolist()
                mask = torch.frombuffer(bytearray(frames[2]), dtype=torch.int32).view(len(rows), -1)
                runner.sample(inf, StepBitmask(mask, rows))
            else:
                inf = runner.launch(M.step_decoder.decode(payload))
            result = runner.collect(inf)
            if rank == 0:
                out.send_multipart([me, M.OK, M.encoder.encode(result)], copy=False)
            continue
        if method == M.SHUTDOWN:
            out.send_multipart([me, M.OK, M.encoder.encode(None)])
            return
        if method == M.CONTROL:
            out.send_multipart([me, *_control(runner, payload)])
            continue
        if method == M.DESCRIBE:
            reply = {"kv_cache_groups": M.encode_groups(runner.kv_cache_groups),
                     "bytes_per_block": runner.bytes_per_block, "device": str(runner.device),
                     "bytes_read": runner.loaded.bytes_read, "pid": os.getpid(),
                     "dist_backend": torch.distributed.get_backend()}
        elif method == M.START_UP:
            from kestrel.worker.build import start_up

            started = start_up(runner.parts, agree=min_over_ranks)  # the same order as in one process
            runner.adopt(started)
            reply = {"num_blocks": started.num_blocks,  # and the decode sizes captured
                     "graph_sizes": runner.graphs.sizes if runner.graphs is not None else []}
        else:
            raise ValueError(f"unknown worker method {method[:32]!r}")
        out.send_multipart([me, M.OK, M.encoder.encode(reply)])


def _control(runner, payload: bytes) -> list[bytes]:
    """Run one control call; its failure is the call's (answered as ctl_fail), never the worker's."""
    from kestrel.errors import InvalidRequest
    from kestrel.worker.control import run_control

    try:
        name, args = M.any_decoder.decode(payload)
        return [M.CTL_OK, M.encoder.encode(run_control(runner, name, args))]
    except Exception as e:  # noqa: BLE001
        logger.warning("control call failed on this rank: %s: %s", type(e).__name__, e)
        return [M.CTL_FAIL, M.encoder.encode([isinstance(e, InvalidRequest), str(e)])]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Kestrel tensor-parallel worker (started by the mp executor)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--log-level", type=int, default=logging.INFO)
    args = p.parse_args(argv)
    die_with_parent()
    if parent_gone(args.parent_pid):
        return
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s tp{args.rank}: %(message)s",
                        datefmt="%H:%M:%S")
    config_dict = json.loads(sys.stdin.read())  # the engine config, as JSON on stdin
    run_worker(config_dict, args.rank, args.size, args.init_method, args.input, args.output,
               parent_pid=args.parent_pid)


if __name__ == "__main__":
    main()
