import pytest

from placement import Plan, PlanError, ResourcePool, Slot, pools_for_plan, slots_from_addresses


def _cluster(hosts=2, per_host=4):
    # Given out of order on purpose: pools order slots by host, then device.
    return [
        Slot(f"tcp://{h}:{9000 + d}", h, d)
        for d in reversed(range(per_host))
        for h in [f"node{i}" for i in reversed(range(hosts))]
    ]


def test_pool_orders_slots_by_host_then_device():
    pool = ResourcePool("all", _cluster())
    assert [(s.host, s.device) for s in pool] == [("node0", d) for d in range(4)] + [("node1", d) for d in range(4)]
    assert pool.hosts == ("node0", "node1")
    assert pool.addresses[0] == "tcp://node0:9000"


def test_split_and_merge():
    pool = ResourcePool("all", _cluster())
    parts = pool.split({"a": 4, "b": 2, "c": 2})
    assert parts["a"].hosts == ("node0",) and len(parts["b"]) == 2
    assert [s.device for s in parts["c"]] == [2, 3]
    assert ResourcePool.merge("bc", [parts["c"], parts["b"]]).slots == pool.slots[4:]
    with pytest.raises(ValueError, match="has 8 slots but the split asks for 9"):
        pool.split({"a": 5, "b": 4})
    with pytest.raises(ValueError, match="lists address tcp://node1:9002 twice"):
        ResourcePool.merge("oops", [parts["c"], parts["c"]])


def test_slot_validation():
    with pytest.raises(ValueError, match="Slot.device must be >= 0"):
        Slot("tcp://x:1", "x", -1)


def test_pools_for_plan_keep_pools_on_whole_nodes():
    plan = Plan.from_dict(
        {
            "placement": [["ref"], ["actor", "critic"], ["reward"]],
            "gpus": {"ref": 2, "actor": 4, "critic": 4, "reward": 2},
        }
    )
    pools = pools_for_plan(plan, _cluster())
    assert list(pools) == ["ref", "actor+critic", "reward"]
    assert pools["actor+critic"].hosts == ("node0",)  # the largest pool goes first, on a node of its own
    assert [(s.host, s.device) for s in pools["ref"]] == [("node1", 0), ("node1", 1)]
    assert [(s.host, s.device) for s in pools["reward"]] == [("node1", 2), ("node1", 3)]
    with pytest.raises(PlanError, match="needs 8 device slots but the cluster has 4"):
        pools_for_plan(plan, _cluster(hosts=1))


def test_asynchronous_replicas_take_the_last_slots_whatever_their_size():
    """A rollout pool (asynchronous RL's replicas) comes after the others, so the link from the trainer to it runs
    over ascending world ranks (flowactors.Controller.link refuses any other order)."""
    plan = Plan.from_dict(
        {
            "placement": [["rollout"], ["actor", "ref"], ["reward"]],
            "gpus": {"rollout": 4, "actor": 2, "ref": 2, "reward": 2},
            "parallel": {"rollout": {"train": [1, 2, 2]}},
        }
    )
    pools = pools_for_plan(plan, _cluster())
    assert [(s.host, s.device) for s in pools["rollout"]] == [("node1", d) for d in range(4)]
    assert [(s.host, s.device) for s in pools["actor+ref"]] == [("node0", 0), ("node0", 1)]


def test_pools_from_worker_addresses():
    addresses = ["tcp://10.0.0.2:4001", "tcp://10.0.0.1:4001", "tcp://10.0.0.1:4002", "tcp://10.0.0.2:4002"]
    slots = slots_from_addresses(addresses)
    assert slots[2] == Slot("tcp://10.0.0.1:4002", "10.0.0.1", 1)
    plan = Plan.from_dict({"placement": [["actor"], ["ref", "reward"]], "gpus": {"actor": 2, "ref": 2, "reward": 2}})
    pools = pools_for_plan(plan, addresses)
    assert pools["actor"].addresses == ("tcp://10.0.0.1:4001", "tcp://10.0.0.1:4002")
    assert pools["ref+reward"].hosts == ("10.0.0.2",)
