"""The replicas' plan (runtime/serving/replicas.py): --replicas, --max-replicas, --routing and --disaggregate
checked before Ray starts, each bad value a one-line error."""

import pytest

from runtime.serving.replicas import ReplicaPlan, app_builder


def test_disaggregate_reads_prefill_and_decode_workers():
    plan = ReplicaPlan.disaggregated("1:3")
    assert (plan.prefill_replicas, plan.replicas, plan.num_engines) == (1, 3, 4)
    assert ReplicaPlan(replicas=2).num_engines == 2


@pytest.mark.parametrize("spec", ["2", "0:1", "1:0", "a:b", "1:2:3", ":1"])
def test_bad_disaggregate_specs_are_refused(spec):
    with pytest.raises(ValueError, match="expected P:D"):
        ReplicaPlan.disaggregated(spec)


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        ReplicaPlan(replicas=0)
    with pytest.raises(ValueError, match="is below --replicas"):
        ReplicaPlan(replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="choose one of prefix, round-robin"):
        ReplicaPlan(routing="random")
    with pytest.raises(ValueError, match="cannot be combined with --disaggregate"):
        ReplicaPlan.disaggregated("1:1", max_replicas=4)
    with pytest.raises(ValueError, match="--nnodes must be >= 1"):
        ReplicaPlan(nnodes=0)
    with pytest.raises(ValueError, match="one-rank engines; it cannot be combined with --nnodes"):
        ReplicaPlan.disaggregated("1:1", nnodes=2)
    with pytest.raises(ValueError, match="leave out --spread"):
        ReplicaPlan(spread=True, nnodes=2)


def test_a_replica_over_several_nodes_is_placed_by_a_strict_spread_placement_group(tmp_path):
    """nnodes > 1 needs Ray even with one replica; its deployment asks for one bundle a node, strictly spread."""
    pytest.importorskip("ray.serve")
    from runtime.serving.fleet import Fleet, ModelSpec
    from runtime.serving.replicas import build_app

    plan = ReplicaPlan(replicas=1, nnodes=2)
    model = ModelSpec("m", tmp_path, plan)
    assert model.on_ray and not ModelSpec("m", tmp_path, ReplicaPlan(replicas=1)).on_ray
    app = build_app(Fleet((model,)), {"m": None}, {"m": {"block_size": 16, "blocks_per_replica": 64,
                                                            "max_batch_size": 8}})
    replicas = app._bound_deployment.init_args[0]["m"]["replicas"]._bound_deployment
    config = replicas._replica_config
    assert config.placement_group_strategy == "STRICT_SPREAD" and config.max_replicas_per_node is None
    assert len(config.placement_group_bundles) == 2
    assert replicas.init_args[3] == 2  # KilnReplica's nnodes


def test_app_builder_names_its_arguments():
    with pytest.raises(ValueError, match="engine=DIR or fleet=FILE is required"):
        app_builder({"replicas": "2"})
    with pytest.raises(ValueError, match="known: .*routing"):
        app_builder({"engine": "engines/x", "replica": "2"})


@pytest.mark.parametrize(("extra", "said"), [
    (["--node-rank", "1"], "Ray places each replica's --nnodes hosts; leave out --node-rank and --master-addr"),
    (["--spread"], "leave out --spread"),
    (["--disaggregate", "1:1"], "cannot be combined with --nnodes"),
])
def test_serve_refuses_what_ray_placed_hosts_cannot_take_in_one_line(extra, said):
    from typer.testing import CliRunner

    from runtime.cli import app

    result = CliRunner().invoke(app, ["serve", "engines/none", "--nnodes", "2", "--ray-address", "10.0.0.1:6379",
                                      *extra])
    lines = result.output.strip().splitlines()
    assert result.exit_code != 0 and len(lines) == 1 and said in lines[0], result.output
