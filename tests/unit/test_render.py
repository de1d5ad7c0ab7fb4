"""Spec + placement -> Serve application config (no cluster)."""

from __future__ import annotations

import pytest

from invalid_manifests import VALID
from moe_operator.api.validation import parse_spec
from moe_operator.planner.initial import initial_placement
from moe_operator.render.serve_app import merge_applications, render_application


def _ingress_options(args: dict) -> dict:
    """build_app(args)'s Ingress deployment options, as Serve will apply them."""
    from moe_workers.serve.app import build_app
    from moe_workers.serve.config import AppArgs

    d = build_app(AppArgs.model_validate(args))._bound_deployment
    return {"ray_actor_options": d.ray_actor_options, "max_ongoing_requests": d.max_ongoing_requests,
            "max_queued_requests": d.max_queued_requests, "backpressure": d.backpressure_config.model_dump()}


def test_render_carries_spec_into_static_args_and_in_place_options():
    spec = parse_spec({**VALID["spec"], "ingress": {"kvCacheBudget": "2Gi", "routePrefix": "/m", "numCpus": 0.5}})
    placement = initial_placement(2, 4, 2)
    app = render_application("team-a", "mixtral", spec, placement)
    assert app["name"] == "team-a.mixtral" and app["route_prefix"] == "/m"
    assert app["import_path"] == "moe_workers.serve.app:build_app"
    args = app["args"]
    assert args["kv_cache_budget_bytes"] == 2 * 2**30 and args["num_groups"] == 2
    assert args["served_model_name"] == "mixtral" and "placement" not in args
    deployments = {d["name"]: d for d in app["deployments"]}
    assert deployments["Ingress"]["user_config"]["placement"] == placement
    assert deployments["ExpertShard-1"]["user_config"]["experts"] == placement["ExpertShard-1"]
    assert deployments["ExpertShard-0"]["num_replicas"] == spec.experts.replicas_per_group


def test_the_cpu_wake_latency_request_is_rendered_into_the_args_and_can_be_turned_off():
    from moe_workers.serve.app import build_app
    from moe_workers.serve.config import AppArgs

    placement = initial_placement(2, 4, 2)
    default = render_application("team-a", "mixtral", parse_spec(VALID["spec"]), placement)["args"]
    assert default["cpu_wake_latency_us"] == 0
    off = parse_spec({**VALID["spec"], "ingress": {"cpuWakeLatencyMicroseconds": -1}})
    args = render_application("team-a", "mixtral", off, placement)["args"]
    assert args["cpu_wake_latency_us"] == -1 and AppArgs.model_validate(args).wake_latency_us() is None
    bound = parse_spec({**VALID["spec"], "ingress": {"cpuWakeLatencyMicroseconds": 20}})
    args = render_application("team-a", "mixtral", bound, placement)["args"]
    assert args["cpu_wake_latency_us"] == 20
    # the shards get it from the builder too
    shards = build_app(AppArgs.model_validate({**args, "placement": placement}))._bound_deployment.init_args[1]
    assert [s._bound_deployment.init_args[6] for s in shards.values()] == [20, 20]
    with pytest.raises(Exception, match="cpuWakeLatencyMicroseconds|cpu_wake_latency"):
        parse_spec({**VALID["spec"], "ingress": {"cpuWakeLatencyMicroseconds": -2}})


def test_the_real_time_priority_is_rendered_to_the_ingress_and_the_shards_and_can_be_turned_off():
    from moe_workers.serve.app import build_app
    from moe_workers.serve.config import AppArgs

    placement = initial_placement(2, 4, 2)
    default = render_application("team-a", "mixtral", parse_spec(VALID["spec"]), placement)["args"]
    assert default["realtime_priority"] == 1
    for spec_value in (0, 5):
        spec = parse_spec({**VALID["spec"], "ingress": {"realtimePriority": spec_value}})
        args = render_application("team-a", "mixtral", spec, placement)["args"]
        assert args["realtime_priority"] == spec_value
        app = build_app(AppArgs.model_validate({**args, "placement": placement}))._bound_deployment
        assert AppArgs.model_validate(app.init_args[0]).realtime_priority == spec_value  # the Ingress
        assert [s._bound_deployment.init_args[8] for s in app.init_args[1].values()] == [spec_value] * 2
    for bad in (-1, 100):
        with pytest.raises(Exception, match="realtimePriority|realtime_priority"):
            parse_spec({**VALID["spec"], "ingress": {"realtimePriority": bad}})


def test_shards_take_cpus_of_their_own_unless_turned_off():
    from moe_workers.serve.app import build_app
    from moe_workers.serve.config import AppArgs

    placement = initial_placement(2, 4, 2)
    for experts, want in (({}, True), ({"pinCpus": False}, False)):
        spec = parse_spec({**VALID["spec"], "experts": {**VALID["spec"]["experts"], **experts}})
        args = render_application("team-a", "mixtral", spec, placement)["args"]
        assert args["pin_shard_cpus"] is want
        shards = build_app(AppArgs.model_validate({**args, "placement": placement}))._bound_deployment.init_args[1]
        assert [s._bound_deployment.init_args[7] for s in shards.values()] == [want, want]


def test_gpus_are_rendered_for_the_ingress_and_the_shards():
    """spec.ingress.numGpus used to be accepted and dropped: the dense part never got a GPU."""
    spec = parse_spec({**VALID["spec"], "ingress": {"numGpus": 1}, "experts": {**VALID["spec"]["experts"], "numGpus": 0.5}})
    args = render_application("team-a", "mixtral", spec, initial_placement(2, 4, 2))["args"]
    assert args["ingress_num_gpus"] == 1 and args["shard_num_gpus"] == 0.5
    ingress = _ingress_options({**args, "placement": initial_placement(2, 4, 2)})
    assert ingress["ray_actor_options"] == {"num_cpus": spec.ingress.num_cpus, "num_gpus": 1}


def test_the_ingress_admits_batch_and_queue_and_the_proxy_refuses_the_rest():
    """Overload is refused by Serve's router in the proxy (503 + Retry-After: 1), not by a
    replica busy with the model: a replica takes its batch, its wait queue and a headroom; the
    proxy's router holds what the admission gate lets in; its engine never refuses what the gate
    let in."""
    from moe_workers.serve.config import (ADMISSION_HEADROOM, MIN_PROXY_QUEUE, AppArgs, admission_capacity,
                                          engine_queue_limit)

    spec = parse_spec({**VALID["spec"], "ingress": {"maxBatchSize": 12, "maxQueuedRequests": 40}})
    args = render_application("team-a", "mixtral", spec, initial_placement(2, 4, 2))["args"]
    ingress = _ingress_options(args)
    assert ingress["max_ongoing_requests"] == 12 + 40 + ADMISSION_HEADROOM
    # Serve's router can hold a burst of all the admission gate lets in while it assigns them
    assert ingress["max_queued_requests"] == admission_capacity(AppArgs.model_validate(args)) == 12 + 40
    assert ingress["backpressure"] == {"status_code": 503, "retry_after_s": 1}
    # everything a replica takes beyond its batch may wait in its engine
    assert engine_queue_limit(AppArgs.model_validate(args)) == ingress["max_ongoing_requests"] - 12
    small = parse_spec({**VALID["spec"], "ingress": {"maxBatchSize": 2, "maxQueuedRequests": 0}})
    ingress = _ingress_options(render_application("team-a", "mixtral", small, initial_placement(2, 4, 2))["args"])
    assert ingress["max_queued_requests"] == MIN_PROXY_QUEUE and ingress["max_ongoing_requests"] == 2 + ADMISSION_HEADROOM


def test_placement_change_leaves_args_alone():
    """Args are Serve's code version: a re-placement must not change them (no restart)."""
    spec = parse_spec(VALID["spec"])
    a = render_application("ns", "m", spec, initial_placement(2, 4, 2))
    moved = initial_placement(2, 4, 2)
    moved["ExpertShard-0"] = moved["ExpertShard-0"] + ["0.2"]
    b = render_application("ns", "m", spec, moved)
    assert a["args"] == b["args"] and a["deployments"] != b["deployments"]


def test_merge_keeps_other_apps_and_refuses_prefix_clash():
    ours = {"name": "ns.m", "route_prefix": "/m"}
    current = [{"name": "other", "route_prefix": "/o"}, {"name": "ns.m", "route_prefix": "/m", "old": True}]
    merged = merge_applications(current, ours)
    assert [a["name"] for a in merged] == ["other", "ns.m"] and "old" not in merged[1]
    with pytest.raises(ValueError, match="route prefix /o is already used by application other"):
        merge_applications(current, {"name": "ns.x", "route_prefix": "/o"})


def test_observed_groups_count_running_replicas():
    from moe_operator.reconcile import observed_groups

    cluster = {"applications": {"ns.m": {"deployments": {
        "ExpertShard-0": {"target_num_replicas": 2, "replicas": [{"state": "RUNNING"}, {"state": "STARTING"}]},
        "ExpertShard-1": {"target_num_replicas": 2, "replicas": [{"state": "RUNNING"}, {"state": "RUNNING"}]},
    }}}}
    placement = {"ExpertShard-0": ["0.0", "0.1"], "ExpertShard-1": ["0.2"]}
    assert observed_groups(cluster, "ns.m", placement, 2) == [
        {"name": "ExpertShard-0", "replicas": 2, "readyReplicas": 1, "experts": 2},
        {"name": "ExpertShard-1", "replicas": 2, "readyReplicas": 2, "experts": 1}]
    assert observed_groups({"applications": {}}, "ns.m", placement, 3)[0]["readyReplicas"] == 3


def test_serve_checks_every_replica_often_enough_to_replace_a_killed_one_soon():
    """Serve notices a SIGKILLed replica only at its next health check (every 10 s by default):
    the app asks for one a second on the Ingress and on every shard group."""
    from moe_workers.serve.app import build_app
    from moe_workers.serve.config import HEALTH_CHECK_PERIOD_S, AppArgs

    spec = parse_spec(VALID["spec"])
    args = render_application("team-a", "mixtral", spec, initial_placement(2, 4, 2))["args"]
    ingress = build_app(AppArgs.model_validate(args))._bound_deployment
    shards = ingress.init_args[1]
    assert HEALTH_CHECK_PERIOD_S <= 2.0
    assert ingress._deployment_config.health_check_period_s == HEALTH_CHECK_PERIOD_S
    assert sorted(shards) == ["ExpertShard-0", "ExpertShard-1"]
    assert all(s._bound_deployment._deployment_config.health_check_period_s == HEALTH_CHECK_PERIOD_S for s in shards.values())


def test_scaling_the_ingress_is_in_place_and_the_admission_gate_follows_it():
    """spec.ingress.replicas used to be a static arg (every replica, shards included, restarted
    to scale the Ingress): now it is the Ingress deployment's num_replicas, with Serve's router
    queue (max_queued_requests) and the capacity each Ingress replica announces to the proxy's
    gate (its user_config) sized for the new count; the app's args are the same."""
    from moe_operator.render.on_change import IN_PLACE, classify
    from moe_workers.serve.config import AppArgs, admission_capacity

    placement = initial_placement(2, 4, 2)
    apps = [render_application("team-a", "mixtral", parse_spec({**VALID["spec"], "ingress": {"replicas": n,
                                "maxBatchSize": 12, "maxQueuedRequests": 40}}), placement) for n in (1, 3)]
    one, three = ({d["name"]: d for d in app["deployments"]}["Ingress"] for app in apps)
    assert apps[0]["args"] == apps[1]["args"] and "ingress_replicas" not in apps[1]["args"]
    assert (one["num_replicas"], three["num_replicas"]) == (1, 3)
    assert three["user_config"]["ingress_replicas"] == 3
    capacity = admission_capacity(AppArgs.model_validate({**apps[1]["args"], "ingress_replicas": 3}))
    assert three["max_queued_requests"] == capacity == 3 * (12 + 40) and one["max_queued_requests"] == 12 + 40
    assert classify(apps[0], apps[1]) == IN_PLACE


def test_an_autoscaled_ingress_is_rendered_for_serves_autoscaler_and_validated_by_serve():
    """spec.ingress.autoscaling becomes the Ingress deployment's autoscaling_config (no
    num_replicas: Serve refuses both), Serve's router queue is sized for the most replicas, and the
    replicas are told to count themselves (AUTO); switching from a fixed count restarts nothing.
    Serve's own schema accepts what is rendered, the prefix router and the KV policy included,
    and both import (as Serve's controller and proxy will import them)."""
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig
    from ray.serve.schema import ServeApplicationSchema

    from moe_operator.render.on_change import IN_PLACE, classify
    from moe_workers.serve.config import AUTO, admission_capacity, AppArgs

    placement = initial_placement(2, 4, 2)
    scaled = {"minReplicas": 2, "maxReplicas": 5, "targetOngoingRequests": 6, "targetKvCacheUsage": 0.75,
              "upscaleDelaySeconds": 3, "downscaleDelaySeconds": 30}
    fixed, auto, plain = (render_application("team-a", "mixtral", parse_spec(
        {**VALID["spec"], "ingress": ingress}), placement) for ingress in (
        {"maxBatchSize": 12, "maxQueuedRequests": 40}, {"maxBatchSize": 12, "maxQueuedRequests": 40, "autoscaling": scaled},
        {"autoscaling": {"maxReplicas": 3}, "prefixRouting": False}))
    ingress = {d["name"]: d for d in auto["deployments"]}["Ingress"]
    assert "num_replicas" not in ingress and ingress["user_config"]["ingress_replicas"] == AUTO
    a = ingress["autoscaling_config"]
    assert (a["min_replicas"], a["max_replicas"], a["initial_replicas"], a["target_ongoing_requests"]) == (2, 5, 2, 6)
    assert (a["upscale_delay_s"], a["downscale_delay_s"]) == (3, 30)
    assert a["policy"]["policy_kwargs"] == {"target_kv_cache_usage": 0.75}
    assert ingress["max_queued_requests"] == admission_capacity(AppArgs.model_validate(auto["args"]), 5) == 5 * 52
    assert auto["args"] == fixed["args"] and classify(fixed, auto) == IN_PLACE
    other = {d["name"]: d for d in plain["deployments"]}["Ingress"]
    assert other["autoscaling_config"]["target_ongoing_requests"] == 32  # a batch (maxBatchSize's default)
    assert "policy" not in other["autoscaling_config"]
    assert other["request_router_config"]["request_router_class"].endswith(":PowerOfTwoChoicesRequestRouter")
    for app in (fixed, auto, plain):
        ServeApplicationSchema.model_validate(app)
    AutoscalingConfig.model_validate(a).policy.get_policy()(target_kv_cache_usage=0.75)
    for d, name in ((ingress, "PrefixAffinityRouter"), (other, "PowerOfTwoChoicesRequestRouter")):
        assert RequestRouterConfig.model_validate(d["request_router_config"]).get_request_router_class().__name__ == name


def test_the_kv_policy_asks_for_the_replicas_that_hold_the_kv_in_use_at_the_target():
    from moe_workers.serve.ingress_scaling import KvAwarePolicy, replicas_for_kv

    assert replicas_for_kv(2, [0.9, 0.9], 0.6) == pytest.approx(3.0)
    assert replicas_for_kv(3, [0.2, 0.1, 0.0], 0.5) == pytest.approx(0.6)
    assert replicas_for_kv(2, [], 0.5) == 2.0
    with pytest.raises(ValueError, match="target_kv_cache_usage"):
        KvAwarePolicy(1.5)


def test_pinned_groups_carry_a_label_selector_and_a_pin_restarts_only_its_deployment():
    from ray.serve.schema import ServeApplicationSchema

    from moe_operator.render.on_change import RESTART_SOME, classify

    placement = initial_placement(2, 4, 2)
    experts = {**VALID["spec"]["experts"], "numCpus": 0.5,
               "rayNodeLabels": {"pool": "a"}, "groupNodes": [{"groups": [1], "rayNodeLabels": {"pool": "b", "zone": "z1"}}]}
    pinned = render_application("team-a", "mixtral", parse_spec(
        {**VALID["spec"], "experts": experts, "ingress": {"rayNodeLabels": {"moe.io/role": "front"}}}), placement)
    plain = render_application("team-a", "mixtral", parse_spec(
        {**VALID["spec"], "experts": {**VALID["spec"]["experts"], "numCpus": 0.5}}), placement)
    d = {x["name"]: x for x in pinned["deployments"]}
    assert d["ExpertShard-0"]["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0, "label_selector": {"pool": "a"}}
    assert d["ExpertShard-1"]["ray_actor_options"]["label_selector"] == {"pool": "b", "zone": "z1"}
    assert d["Ingress"]["ray_actor_options"]["label_selector"] == {"moe.io/role": "front"}
    assert all("ray_actor_options" not in x for x in plain["deployments"])
    assert pinned["args"] == plain["args"]  # no static arg: nothing else restarts
    ServeApplicationSchema.model_validate(pinned)
    one = render_application("team-a", "mixtral", parse_spec({**VALID["spec"], "experts": {
        **VALID["spec"]["experts"], "numCpus": 0.5, "groupNodes": [{"groups": [0], "rayNodeLabels": {"p": "x"}}]}}), placement)
    assert classify(plain, one) == RESTART_SOME


def test_a_pin_no_live_node_can_take_is_named_with_the_nodes_there_are():
    from moe_operator.backends.serve_status import pinned, unplaceable_pins

    placement = initial_placement(2, 4, 2)
    app = render_application("team-a", "mixtral", parse_spec({**VALID["spec"], "experts": {
        **VALID["spec"]["experts"], "numCpus": 2,
        "groupNodes": [{"groups": [0], "rayNodeLabels": {"pool": "a"}}, {"groups": [1], "rayNodeLabels": {"pool": "c"}}]}}),
        placement)
    assert set(pinned(app)) == {"ExpertShard-0", "ExpertShard-1"}
    node = lambda pool, cpus, state="ALIVE": {"state": state, "labels": {"pool": pool, "ray.io/node-id": "x"},  # noqa: E731
                                              "resources_total": {"CPU": cpus}}
    assert unplaceable_pins(app, [node("a", 4), node("c", 2)]) is None
    missing = unplaceable_pins(app, [node("a", 4), node("b", 4), node("c", 8, state="DEAD")])
    assert missing.startswith("ExpertShard-1 is pinned to Ray nodes labelled pool=c, and no live node has them")
    assert "ExpertShard-0" not in missing and "live nodes' labels: pool=a; pool=b" in missing
    small = unplaceable_pins(app, [node("a", 1), node("c", 2)])
    assert small.startswith("ExpertShard-0 is pinned to Ray nodes labelled pool=a, and none of the 1 with them has 2 CPU")
    assert unplaceable_pins(render_application("t", "m", parse_spec(VALID["spec"]), placement), []) is None
