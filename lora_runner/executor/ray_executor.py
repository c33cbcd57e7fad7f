"""RayExecutor: one Ray actor per tensor-parallel rank, in one placement group, one message per step.

The actors (lora_runner.executor.ray_actor) each take one bundle of a STRICT_PACK placement group (one
CPU, or one GPU and one CPU, per rank: every rank on one node), or the bundles of the group the caller
already runs in (a Ray Serve replica given ``placement_group_bundles``: its first bundle holds the replica
and rank 0; lora_runner.entrypoints.ray.placement). Rank 0's actor picks the group's address and port;
all join one torch.distributed group (gloo on CPU, nccl on CUDA).

Each step's message is encoded once and put in the object store once (``ray.put``); the same ObjectRef
goes to every actor. Adapter weights do not ride in it: as with "mp", each version is written once to
shared memory (/dev/shm, lora_runner.executor.shared_weights) and named by a handle, which works because
the placement group keeps every actor on the engine's node (its bundles ask for a share of the node's
"node:<ip>" resource; a Serve replica's group is packed with the replica).

A rank that dies (RayActorError), fails a step (RayTaskError) or does not answer within ``step_timeout_s``
makes ``execute`` raise EngineDeadError; every actor is then killed and a placement group this executor
made is removed. ``close()`` and garbage collection do the same, so nothing is left behind.
"""

from __future__ import annotations

import logging
import time
import weakref

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lora_runner.executor.errors import EngineDeadError
from lora_runner.executor.ranked import RankedExecutor
from lora_runner.executor.ray_actor import RankActor
from lora_runner.executor.shared_weights import SharedWeights
from lora_runner.executor.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

NODE_SHARE = 0.001  # of a node's "node:<ip>" resource (1.0), asked by each bundle to pin it to that node


def rank_bundles(world_size: int, device_type: str) -> list[dict[str, float]]:
    """One placement-group bundle per rank: {"CPU": 1}, plus {"GPU": 1} on CUDA."""
    bundle = {"CPU": 1.0} if device_type == "cpu" else {"CPU": 1.0, "GPU": 1.0}
    return [dict(bundle) for _ in range(world_size)]


class RayExecutor(RankedExecutor):
    """``world_size`` RankActors built from ``spec``, in their placement group.

    Attributes: ``actors`` (the actor handles, rank order), ``placement_group`` and ``owns_group`` (False
    when the ranks use the caller's group, left to its owner), ``counts`` ("messages", "pickles", "puts": object
    store puts, "sends": actor calls), ``shared``. Needs ``ray.init()`` done (or does it, locally). Raises
    RuntimeError when the group cannot be placed or a rank fails to start; nothing is left running then.
    """

    def __init__(self, spec: WorkerSpec, world_size: int) -> None:
        super().__init__(spec, world_size)
        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        bundles = rank_bundles(world_size, spec.device_type)
        current = get_current_placement_group()
        if current is not None:  # a Serve replica's group: rank r takes bundle r (bundle 0 holds the replica)
            if len(current.bundle_specs) < world_size:
                raise RuntimeError(f"this process runs in a placement group of {len(current.bundle_specs)} "
                                   f"bundles; {world_size} ranks need one each")
            self.placement_group, self.owns_group = current, False
        else:
            # on this node: the ranks map the adapter weights' files this process writes to its /dev/shm
            here = {f"node:{ray.util.get_node_ip_address()}": NODE_SHARE}
            group = placement_group([{**bundle, **here} for bundle in bundles], strategy="STRICT_PACK")
            self.placement_group, self.owns_group = group, True
        self.actors: list = []
        self._finalizer = weakref.finalize(self, _stop_actors, self.actors,
                                           self.placement_group if self.owns_group else None, self.shared)
        try:
            self._start(spec, bundles)
        except (EngineDeadError, GetTimeoutError, RayError) as error:
            self.close()
            raise RuntimeError(f"tensor-parallel Ray actors failed to start: {error}") from error

    def _start(self, spec: WorkerSpec, bundles: list[dict]) -> None:
        if self.owns_group and not _wait_ready(self.placement_group, spec.startup_timeout_s):
            raise GetTimeoutError(f"a placement group of {len(bundles)} bundles {bundles[0]} on one node "
                                  f"could not be placed within {spec.startup_timeout_s:.0f} s "
                                  f"(cluster resources: {ray.cluster_resources()})")
        actor_class = ray.remote(RankActor)
        for rank, bundle in enumerate(bundles):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
            options = dict(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0), scheduling_strategy=strategy,
                           name=None, max_restarts=0, max_concurrency=1)
            self.actors.append(actor_class.options(**options).remote(rank, self.world_size, spec))
        host, port = ray.get(self.actors[0].pick_address.remote(), timeout=spec.startup_timeout_s)
        ready = self._gather([actor.start.remote(host, port) for actor in self.actors], spec.startup_timeout_s,
                             "start")
        self.slot_nbytes = {kind: sum(r[kind] for r in ready) for kind in ("lora", "prompt")}

    def is_alive(self) -> bool:
        """True while no step failed (a dead actor shows at the next step, within seconds)."""
        return self._dead is None

    def close(self) -> None:
        """Kill every actor, remove the placement group this executor made and the shared weight files;
        idempotent."""
        self._finalizer()

    # ------------------------------------------------------------------------- one message
    def _deliver(self, payload: bytes) -> list:
        """One ``ray.put`` of the bytes; the same ObjectRef to every actor; their replies in rank order."""
        ref = ray.put(payload)
        self.counts["puts"] += 1
        calls = []
        for actor in self.actors:
            calls.append(actor.step.remote(ref))
            self.counts["sends"] += 1
        replies = self._gather(calls, self.spec.step_timeout_s, "step")
        for rank, (_, messages) in enumerate(replies):
            self.rank_messages[rank] = messages
        return [result for result, _ in replies]

    def _gather(self, calls: list, timeout: float, what: str) -> list:
        """Every call's result (rank order) within ``timeout`` s. Results are taken as they come, so a dead
        actor is seen at once even while the other ranks wait in a collective for it."""
        deadline, replies = time.monotonic() + timeout, [None] * len(calls)
        pending = {call: rank for rank, call in enumerate(calls)}
        while pending:
            remaining = deadline - time.monotonic()
            ready = ray.wait(list(pending), num_returns=1, timeout=remaining)[0] if remaining > 0 else []
            if not ready:
                self._die(f"no answer from rank(s) {sorted(pending.values())} within {timeout:.1f} s ({what})")
            for call in ready:
                rank = pending.pop(call)
                try:
                    replies[rank] = ray.get(call)
                except RayActorError as error:
                    self._die(f"tensor-parallel Ray actor {rank} died ({what}): {error}")
                except RayError as error:
                    self._die(f"tensor-parallel Ray actor {rank} failed ({what}):\n{error}")
        return replies


def _wait_ready(group: PlacementGroup, timeout: float) -> bool:
    """True once every bundle of ``group`` is reserved, False after ``timeout`` s."""
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    return bool(ready)


def _stop_actors(actors: list, group: PlacementGroup | None, shared: SharedWeights) -> None:
    """Kill every actor (no restart), remove ``group`` (None: the caller owns it) and the shared files."""
    if not ray.is_initialized():  # Ray shut down first: its actors and groups went with it
        actors.clear()
        shared.close()
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except (RayError, ValueError) as error:  # already gone, or Ray shut down first
            logger.debug("killing a tensor-parallel actor: %s", error)
    actors.clear()
    if group is not None:
        try:
            remove_placement_group(group)
        except (RayError, ValueError) as error:
            logger.debug("removing the placement group: %s", error)
    shared.close()
