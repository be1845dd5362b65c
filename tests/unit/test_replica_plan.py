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


def test_app_builder_names_its_arguments():
    with pytest.raises(ValueError, match="engine=DIR or fleet=FILE is required"):
        app_builder({"replicas": "2"})
    with pytest.raises(ValueError, match="known: .*routing"):
        app_builder({"engine": "engines/x", "replica": "2"})
