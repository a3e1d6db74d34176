"""Worker ranks as Ray actors (`--distributed-executor-backend ray`), as vLLM reaches other machines: one actor a
rank in a placement group of the Ray cluster the user started (`ray start`; RAY_ADDRESS, or a local one when none
runs), each connecting back to the driver over TCP. Ray is imported only here, when asked for."""

from pegainfer.errors import PegainferError
from pegainfer.runtime.rank_links import DriverLinks
from pegainfer.runtime.rank_workers import RankProcesses, RankSpec, rank_environment, serve_rank


class RankActor:
    """A worker rank's process. `serve` holds the actor for the engine's life; `pid` answers beside it."""

    def serve(self, spec: RankSpec, rank: int, address: tuple[str, int], authkey: bytes) -> None:
        serve_rank(spec, rank, address, authkey)

    def pid(self) -> int:
        import os

        return os.getpid()


def start_actors(spec: RankSpec) -> RankProcesses:
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise PegainferError("--distributed-executor-backend ray needs Ray: pip install 'ray>=2.40'") from None
    if not ray.is_initialized():
        ray.init(runtime_env={"env_vars": rank_environment()}, log_to_driver=False)
    bundle = {"GPU": 1, "CPU": 1} if spec.device == "cuda" else {"CPU": 1}
    group = placement_group([bundle] * (spec.world - 1), strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=60)
    if not ready:
        remove_placement_group(group)
        raise PegainferError(f"the Ray cluster has no room for {spec.world - 1} worker ranks of {bundle} each "
                             f"(its resources: {ray.cluster_resources()})")
    links = DriverLinks(spec.world, host=ray.util.get_node_ip_address())
    actor_class = ray.remote(max_concurrency=2)(RankActor)
    actors = [actor_class.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(group, index)).remote()
              for index in range(spec.world - 1)]
    runs = [actor.serve.remote(spec, rank, links.address, links.authkey) for rank, actor in enumerate(actors, 1)]

    def dead() -> str | None:
        finished, _ = ray.wait(runs, num_returns=1, timeout=0)
        return _why(ray, runs, finished[0]) if finished else None

    def wait_any() -> str:
        finished, _ = ray.wait(runs, num_returns=1)
        return _why(ray, runs, finished[0])

    def stop() -> None:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
    return RankProcesses(links, dead, wait_any, stop, lambda: ray.get([actor.pid.remote() for actor in actors]))


def _why(ray, runs: list, finished) -> str:
    rank = runs.index(finished) + 1
    try:
        ray.get(finished)
    except Exception as error:  # noqa: BLE001  whatever Ray says of the actor's end is the reason given
        return f"rank {rank}'s Ray actor: {type(error).__name__}: {str(error).splitlines()[0]}"
    return f"rank {rank}'s Ray actor returned"
