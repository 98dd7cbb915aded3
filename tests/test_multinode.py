"""Runs over several Ray nodes: placement as configuration, cluster-correct addresses, control tokens, and a
real multi-node run on one machine.

`ray.cluster_utils.Cluster` starts separate raylets (their own resources, their own worker processes) on this
machine: the placement, the rendezvous on rank 0's node and the weight-update group go through the same Ray
and torch.distributed paths as on separate machines. What it cannot show is a second machine's network
and filesystem; every node here has the same IP, and the run's shared folder is a local one.
"""

from __future__ import annotations

import time

import httpx
import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from rlflow.engines.cluster.placement import NodeInfo, PlacementError, RoleDemand, plan
from rlflow.engines.core.config import config_from_dict
from rlflow.engines.rollout.router import RolloutRouter
from rlflow.engines.rollout.torch_backend import TorchRolloutBackend
from rlflow.engines.session.workers import start_workers
from rlflow.engines.store.run_store import RunStore
from rlflow.flows.post_train import post_train
from rlflow.tasks.run_context import active_run
from tests.conftest import small_recipe, step_metrics

# ---- the plan: pure, no Ray ---------------------------------------------------------------------------------


def _nodes(*resources: dict) -> list[NodeInfo]:
    return [NodeInfo(f"{i:02d}" + "ab" * 27, f"10.0.0.{i + 1}", r) for i, r in enumerate(resources)]


def test_plan_packs_each_node_and_spreads_roles_worst_fit():
    nodes = _nodes({"CPU": 16, "GPU": 8}, {"CPU": 16, "GPU": 8}, {"CPU": 16, "GPU": 8})
    chosen = plan([RoleDemand("train", 8, 2, {"CPU": 1, "GPU": 1}),
                   RoleDemand("rollout", 8, 1, {"CPU": 1, "GPU": 1})], nodes)
    assert [n.ip for n in chosen["train"]] == ["10.0.0.1", "10.0.0.2"]  # 4 per node
    assert [n.ip for n in chosen["rollout"]] == ["10.0.0.3"]  # the node with the most free GPUs


def test_plan_error_names_the_field_and_every_node():
    nodes = _nodes({"CPU": 16, "GPU": 8}, {"CPU": 16, "GPU": 4})
    with pytest.raises(PlacementError, match=r"train\.nodes: 16 train worker\(s\) over 2 node\(s\) need 2 node\(s\) "
                       r"with \{CPU 8, GPU 8\} free each; 1 such node") as err:
        plan([RoleDemand("train", 16, 2, {"CPU": 1, "GPU": 1})], nodes)
    assert "10.0.0.2" in str(err.value) and "GPU 4/4 free" in str(err.value)


def test_plan_error_counts_the_roles_placed_before():
    nodes = _nodes({"CPU": 8, "GPU": 8})
    with pytest.raises(PlacementError, match=r"rollout\.nodes: .* after placing train on 1 node\(s\).*GPU 0/8 free"):
        plan([RoleDemand("train", 8, 1, {"CPU": 1, "GPU": 1}), RoleDemand("rollout", 1, 1, {"CPU": 1, "GPU": 1})],
             nodes)


def test_uneven_or_mismatched_nodes_are_refused_by_the_recipe(tmp_path):
    with pytest.raises(ValueError, match=r"train\.nodes: train\.num_workers \(4\) must split evenly over 3 nodes"):
        config_from_dict(small_recipe(tmp_path, train={"num_workers": 4, "nodes": 3}))
    with pytest.raises(ValueError, match=r"critic\.nodes: critic\.num_workers \(1\) must split evenly over 2"):
        config_from_dict(small_recipe(tmp_path, critic={"nodes": 2}))
    with pytest.raises(ValueError, match=r"cluster\.colocate: rollout\.nodes \(1\) must equal train\.nodes \(2\)"):
        config_from_dict(small_recipe(tmp_path, train={"num_workers": 2, "nodes": 2, "device": "cuda"},
                                      rollout={"num_workers": 2, "device": "cuda"}, cluster={"colocate": True}))


# ---- control routes need the run's token ---------------------------------------------------------------------


def test_control_routes_need_the_run_token_on_servers_and_router(tiny_model_dir):
    backend = TorchRolloutBackend(tiny_model_dir, threads=1, batch_size=4)
    url = backend.start_server(token="s3cret")
    router = RolloutRouter([url], token="s3cret")
    try:
        with httpx.Client(timeout=60) as http:
            for route in ("/flush_cache", "/abort_request", "/release_memory_occupation"):
                r = http.post(url + route, json={"abort_all": True} if route == "/abort_request" else {})
                assert r.status_code == 401 and "control token" in r.text, route
            assert http.post(url + "/flush_cache", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert http.post(url + "/flush_cache", headers={"Authorization": "Bearer s3cret"}).status_code == 200
            gen = http.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
            assert gen.status_code == 200  # generation stays open
            assert http.post(router.url + "/flush_cache").status_code == 401  # the router's control routes too
            auth = {"Authorization": "Bearer s3cret"}
            assert http.post(router.url + "/flush_cache", headers=auth).json()["success"]  # and it sends the token on
            assert http.post(router.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {
                "max_new_tokens": 2}}).status_code == 200
    finally:
        router.stop()
        backend.close()
    # the worker's own calls to its server carry the token too (the distributed transport drives them)
    backend = TorchRolloutBackend(tiny_model_dir, threads=1, batch_size=4)
    try:
        backend.start_server(token="t0k")
        backend._post_own("/flush_cache", {})
    finally:
        backend.close()


# ---- a run over three nodes -----------------------------------------------------------------------------------

STEPS = 4


@pytest.fixture(scope="module")
def cluster():
    """A head that runs nothing (0 CPUs: the driver's node) and three worker nodes of one CPU each."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 100 * 2**20,
                                                      "include_dashboard": False})
    workers = [c.add_node(num_cpus=1, object_store_memory=80 * 2**20) for _ in range(3)]
    c.wait_for_nodes()
    ray.shutdown()  # a Ray an earlier test of this process left running (another file's, under pytest-xdist)
    ray.init(address=c.address)
    yield c, workers
    ray.shutdown()
    c.shutdown()


def _cfg(tmp_path, c: Cluster, name: str, **sections):
    raw = small_recipe(tmp_path, name=name, train={"steps": STEPS, "threads": 1, "num_workers": 2, "nodes": 2},
                       rollout={"num_workers": 1}, eval={"every": 0}, checkpoint={"every": 1},
                       weight_sync={"transport": "distributed"},
                       cluster={"address": c.address, "cpus_per_worker": 0.5, "shared_dir": str(tmp_path / "shared"),
                                "collective_timeout_s": 20})
    for key, value in sections.items():
        raw[key] = {**raw[key], **value}
    return config_from_dict(raw)


def _run(cfg, listeners=()) -> dict[int, dict]:
    """post_train(cfg); the metrics of each step it ran (raises what the flow raised)."""
    return step_metrics(lambda: post_train(cfg), listeners)[0]


def test_a_run_over_three_nodes_learns_as_on_one_and_survives_losing_a_node(cluster, tmp_path):
    c, worker_nodes = cluster
    cfg = _cfg(tmp_path, c, "multinode")
    where: dict[str, list[str]] = {}
    urls: list[str] = []

    def remove_a_train_node(step: int, metrics: dict) -> None:
        session = active_run(cfg.name).session
        urls[:] = [*session.server_urls, session.router.url]
        tables = [t for t in placement_group_table().values() if t["state"] == "CREATED"]
        where.update({t["name"]: sorted(set(t["bundles_to_node_id"].values())) for t in tables
                      if t["name"].startswith("multinode-")})
        if step == 1:  # step 1's checkpoint is committed before its listeners run
            c.remove_node(next(n for n in worker_nodes if n.node_id == where["multinode-train-pg1"][0]))

    t0 = time.monotonic()
    history: dict[int, dict] = {}
    with pytest.raises(Exception):  # noqa: B017 - the lost rank fails the next step's stage, whichever it is
        _run(cfg, [remove_a_train_node, lambda step, m: history.__setitem__(step, m)])
    failed_after = time.monotonic() - t0

    # the train ranks ran on two nodes, the rollout worker on the third, the driver on none of them
    train_nodes = where["multinode-train-pg0"] + where["multinode-train-pg1"]
    assert len(set(train_nodes)) == 2 and where["multinode-rollout-pg0"][0] not in train_nodes
    assert ray.get_runtime_context().get_node_id() not in {*train_nodes, *where["multinode-rollout-pg0"]}
    assert sorted(history) == [0, 1] and all(m["sync/bytes"] > 0 for m in history.values())
    ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == where["multinode-rollout-pg0"][0])
    driver_ip = ray.util.get_node_ip_address()
    assert urls[0].startswith(f"http://{ip}:") and ip != "127.0.0.1"  # the rollout server: its node, not loopback
    assert urls[-1].startswith(f"http://{driver_ip}:")  # the router: the driver's node
    store = RunStore(cfg.storage, cfg.name)
    assert store.committed_steps()[-1] == 1
    assert failed_after < 300, f"the lost node held the run for {failed_after:.0f} s instead of failing a stage"

    # the same steps in one process (one train rank, no Ray): the same samples, rewards and losses
    one = _run(_cfg(tmp_path, c, "one-node", train={"steps": 2, "num_workers": 1, "nodes": 1},
                    weight_sync={"transport": "ray"}, cluster={"use_ray": False}))
    for step in (0, 1):
        assert history[step]["rollout/reward_mean"] == one[step]["rollout/reward_mean"], step
        assert history[step]["train/loss"] == pytest.approx(one[step]["train/loss"], abs=1e-5), step

    # resumed on the two nodes left: it picks up after the last committed step and finishes
    resumed = _run(cfg)
    assert sorted(resumed) == list(range(2, STEPS))
    assert store.read_json("status.json")["status"] == "finished" and store.latest_step() == STEPS - 1
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in resumed.values())


def test_workers_on_other_nodes_need_a_shared_dir(cluster, tmp_path):
    """They read the model and write checkpoint shards by path: refused before any actor starts, placement
    groups released."""
    c, _ = cluster
    cfg = _cfg(tmp_path, c, "no-shared-dir", cluster={"shared_dir": None})
    with pytest.raises(PlacementError, match=r"cluster\.shared_dir: this run's workers are placed on other nodes"):
        start_workers(cfg, str(tmp_path / "model"), use_ray=True)
    assert not [t for t in placement_group_table().values()
                if t["name"].startswith("no-shared-dir") and t["state"] != "REMOVED"]


def test_workers_on_other_nodes_need_no_shared_dir_with_an_object_store(cluster, tmp_path, s3_bucket,
                                                                          tiny_model_dir):
    """With the run store on S3 the train workers write and read checkpoint shards there themselves, and the
    model is the recipe's model.path: the workers start on other nodes without cluster.shared_dir."""
    c, _ = cluster
    root, endpoint = s3_bucket
    cfg = _cfg(tmp_path, c, "s3-no-shared-dir", cluster={"shared_dir": None}, model={"path": tiny_model_dir},
               storage={"uri": root, "endpoint_url": endpoint})
    workers = start_workers(cfg, tiny_model_dir, use_ray=True)
    try:
        assert workers.spans_nodes and len(workers.train) == 2
    finally:
        workers.shutdown()
    local = _cfg(tmp_path, c, "file-no-shared-dir", cluster={"shared_dir": None}, model={"path": tiny_model_dir})
    with pytest.raises(PlacementError, match=r"cluster\.shared_dir: .*\(or use object storage for storage\.uri"):
        start_workers(local, tiny_model_dir, use_ray=True)


def test_a_plan_the_cluster_holds_but_other_jobs_occupy_fails_after_the_timeout(cluster, monkeypatch):
    """The plan reads total resources; what other jobs hold shows only when Ray cannot reserve the bundles:
    that fails after PLACEMENT_TIMEOUT_S with what is available, and nothing stays reserved."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from rlflow.engines.cluster import placement

    workers = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1]  # one may be removed
    busy = [placement_group([{"CPU": 1}], strategy="STRICT_PACK") for _ in workers]  # every worker node's CPU
    try:
        ray.get([pg.ready() for pg in busy], timeout=60)
        monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 2)
        with pytest.raises(RuntimeError, match=r"could not reserve busy-train .* within 2 s: other jobs hold them"):
            placement.place([RoleDemand("train", 2, 2, {"CPU": 0.5})], "busy")
        assert not [t for t in placement_group_table().values()
                    if t["name"].startswith("busy-") and t["state"] != "REMOVED"]
    finally:
        for pg in busy:
            remove_placement_group(pg)
