"""Tensor-parallel workers as Ray actors on an existing cluster (`ray start --head`, `ray start --address`): one
placement-group bundle per rank (a GPU each, or a CPU each on a CPU cluster), the same ZeroMQ channel as the mp
executor over tcp (the engine's node address), and the process group over tcp on rank 0's node. Ray places and
starts the workers; it carries no step traffic. Needs the optional extra: pip install kestrel[ray]."""
from __future__ import annotations

import logging

from kestrel.errors import ConfigError
from kestrel.executor.multiproc import MultiWorkerExecutor

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60


class RayWorker:
    """The actor: reports where rank 0 can host the process group, then runs the worker loop until shutdown."""

    def address(self) -> tuple[str, int]:
        import ray

        from kestrel.distributed import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def run(self, config_dict: dict, rank: int, size: int, init_method: str, input_addr: str, output_addr: str,
            log_level: int = logging.INFO):
        from kestrel.executor.worker import run_worker

        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp{rank}: %(message)s")
        run_worker(config_dict, rank, size, init_method, input_addr, output_addr, local_index=0)


class RayExecutor(MultiWorkerExecutor):
    def _start(self, config) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise ConfigError("--distributed-executor-backend ray needs Ray: pip install 'kestrel[ray]'") from e
        self._ray = ray
        self._actors, self._runs, self._pg = [], [], None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            address = config.parallel.ray_address or "auto"
            try:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
            except ConnectionError as e:
                raise ConfigError(f"no Ray cluster at {address!r} ({e}); start one with `ray start --head` "
                                  "or pass --ray-address") from e
        device = config.model.device
        gpus = ray.cluster_resources().get("GPU", 0)
        use_gpu = device == "cuda" or (device == "auto" and gpus > 0)
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self._pg = placement_group([bundle] * self.size, strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ConfigError(f"the Ray cluster cannot place {self.size} workers of {bundle} within "
                              f"{PLACEMENT_TIMEOUT_S} s (cluster resources: {ray.cluster_resources()})")
        ip = ray.util.get_node_ip_address()
        inputs, output = self._bind(lambda name: f"tcp://{ip}:0")
        actor_cls = ray.remote(RayWorker)
        for rank in range(self.size):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            self._actors.append(actor_cls.options(num_cpus=1, num_gpus=1 if use_gpu else 0,
                                                  scheduling_strategy=strategy).remote())
        host, port = ray.get(self._actors[0].address.remote())
        init = f"tcp://{host}:{port}"
        cfg = config.to_dict()
        level = logging.getLogger("kestrel").getEffectiveLevel() or logging.INFO  # the engine's, as mp passes it
        self._runs = [a.run.remote(cfg, rank, self.size, init, inputs[rank], output, level)
                      for rank, a in enumerate(self._actors)]

    def _find_dead(self, exclude: int | None = None) -> str | None:
        ray = self._ray
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        for ref in done:
            rank = self._runs.index(ref)
            if rank == exclude:
                continue
            try:
                ray.get(ref)
                why = "exited"
            except Exception as e:  # the actor died (killed, node lost) or its loop raised
                why = f"died: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return f"tensor-parallel worker rank {rank} (Ray actor) {why}"
        return None

    def _stop_workers(self) -> None:
        ray = getattr(self, "_ray", None)
        if ray is None:
            return
        if self._runs and not self.dead:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=3)
        for a in self._actors:
            ray.kill(a)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
        self._actors, self._runs, self._pg = [], [], None
        if self._owns_ray:
            ray.shutdown()
