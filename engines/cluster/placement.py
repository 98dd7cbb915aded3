"""Where each role's workers run: a plan over the Ray cluster's nodes, checked before any actor starts.

A role (the policy's train workers, the rollout workers, the critic's) asks for N workers over K nodes, each
worker with a bundle of resources (CPUs, a GPU, an SGLang server's GPUs). The plan picks K nodes that each
hold N/K bundles; a recipe the cluster cannot hold fails here, naming the recipe field and every node's
resources, instead of waiting on Ray for minutes. Then each (role, node) becomes one STRICT_PACK placement
group pinned to its node by Ray's node-id label: workers of a node are packed on it, nodes are distinct.
Colocated rollout workers take no plan of their own: rollout worker i shares train worker i's bundle.

Nodes are chosen worst-fit (most free GPUs, then CPUs, first): roles land on separate nodes when the
cluster has room, as a disaggregated run wants, and a one-node cluster gets everything, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

PLACEMENT_TIMEOUT_S = 300
NODE_LABEL = "ray.io/node-id"  # a label Ray gives every node


class PlacementError(ValueError):
    """A recipe asks for more than the cluster has (raised before any worker starts)."""


@dataclass(frozen=True)
class RoleDemand:
    """`workers` copies of one bundle over `nodes` nodes. `field` is the recipe section it comes from
    (`train`, `rollout`, `critic`), named in errors."""

    field: str
    workers: int
    nodes: int
    bundle: dict[str, float]

    @property
    def per_node(self) -> int:
        if self.workers % self.nodes:
            raise PlacementError(f"{self.field}.nodes: {self.field}.num_workers ({self.workers}) must split evenly "
                                 f"over {self.nodes} nodes")
        return self.workers // self.nodes


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    resources: dict[str, float]

    def describe(self, free: dict[str, float]) -> str:
        keys = sorted(k for k in self.resources if not k.startswith(("node:", "memory", "object_store")))
        return f"{self.ip} {self.node_id[:8]} (" + ", ".join(
            f"{k} {free.get(k, 0):g}/{self.resources[k]:g} free" for k in keys) + ")"


def cluster_nodes() -> list[NodeInfo]:
    """The alive nodes of the Ray cluster this process joined, in Ray's order."""
    return [NodeInfo(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"])) for n in ray.nodes() if n["Alive"]]


def plan(demands: list[RoleDemand], nodes: list[NodeInfo]) -> dict[str, list[NodeInfo]]:
    """For each role, the nodes its workers go to (node j holds workers j*per_node ... (j+1)*per_node - 1).
    Raises PlacementError naming the role's field when the cluster cannot hold it beside the roles before it."""
    free = {n.node_id: dict(n.resources) for n in nodes}
    out = {}
    for d in demands:
        need = {k: v * d.per_node for k, v in d.bundle.items() if v}
        fits = [n for n in nodes if all(free[n.node_id].get(k, 0) >= v - 1e-9 for k, v in need.items())]
        if len(fits) < d.nodes:
            placed = ", ".join(f"{f} on {len(ns)} node(s)" for f, ns in out.items()) or "nothing yet"
            raise PlacementError(
                f"{d.field}.nodes: {d.workers} {d.field} worker(s) over {d.nodes} node(s) need {d.nodes} node(s) with "
                f"{_fmt(need)} free each; {len(fits)} such node(s) after placing {placed}. Nodes: "
                + "; ".join(n.describe(free[n.node_id]) for n in nodes))
        chosen = sorted(fits, key=lambda n: (-free[n.node_id].get("GPU", 0), -free[n.node_id].get("CPU", 0)))
        out[d.field] = chosen[: d.nodes]
        for n in out[d.field]:
            for k, v in need.items():
                free[n.node_id][k] = free[n.node_id].get(k, 0) - v
    return out


@dataclass
class Placement:
    """One role's placement groups, one per node, and the slot (group, bundle) of each worker rank."""

    demand: RoleDemand
    nodes: list[NodeInfo]
    groups: list[Any] = field(default_factory=list)

    @classmethod
    def create(cls, demand: RoleDemand, nodes: list[NodeInfo], name: str) -> Placement:
        """Reserve the bundles on their nodes and wait for them (a busy cluster fails after a timeout)."""
        placement = cls(demand, nodes)
        bundles = [dict(demand.bundle) for _ in range(demand.per_node)]
        for j, node in enumerate(nodes):
            placement.groups.append(placement_group(
                bundles, strategy="STRICT_PACK", name=f"{name}-pg{j}",
                bundle_label_selector=[{NODE_LABEL: node.node_id}] * len(bundles)))
        try:
            ray.get([pg.ready() for pg in placement.groups], timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            placement.remove()
            raise RuntimeError(f"cluster: Ray could not reserve {name} ({demand.per_node} x {demand.bundle} on each "
                               f"of {[n.ip for n in nodes]}) within {PLACEMENT_TIMEOUT_S} s: other jobs hold them; "
                               f"available: {ray.available_resources()}") from None
        for pg, node in zip(placement.groups, nodes, strict=True):  # Ray releases before 2.5x could drop the label
            landed = set(placement_group_table(pg)["bundles_to_node_id"].values())
            if landed != {node.node_id}:
                placement.remove()
                raise RuntimeError(f"cluster: Ray placed {name} on nodes {sorted(landed)}, not on {node.node_id} as "
                                   "asked (its bundle_label_selector was ignored: use the Ray of constraints.txt)")
        return placement

    def __len__(self) -> int:
        return self.demand.workers

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        per = self.demand.per_node
        return PlacementGroupSchedulingStrategy(self.groups[rank // per], rank % per)

    def node(self, rank: int) -> NodeInfo:
        return self.nodes[rank // self.demand.per_node]

    def remove(self) -> None:
        for pg in self.groups:
            remove_placement_group(pg)
        self.groups.clear()


def place(demands: list[RoleDemand], name: str = "") -> dict[str, Placement]:
    """Plan every role on the cluster (all checked before anything is reserved), then reserve each; its
    placement groups are named `<name>-<field>-pg<node>`."""
    chosen = plan(demands, cluster_nodes())
    out: dict[str, Placement] = {}
    try:
        for d in demands:
            out[d.field] = Placement.create(d, chosen[d.field], f"{name}-{d.field}" if name else d.field)
    except BaseException:
        for p in out.values():
            p.remove()
        raise
    return out


def driver_node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items())) + "}"
