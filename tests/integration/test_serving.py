"""The Serve app on a real local Ray: concurrent clients get the reference's tokens; bad requests get 4xx."""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time

import pytest
import requests
import torch

from checkpoints import make_mixtral
from flood import flood
from moe_workers.model.inprocess import InProcessModel
from moe_workers.serve.config import serve_application
from sched_class import rr_allowed
from serve_rest import delete_all, deploy
from waiting import wait_for

pytestmark = pytest.mark.ray

NUM_LAYERS, NUM_EXPERTS = 3, 8


@pytest.fixture(scope="module")
def served(ray_head, tmp_path_factory):
    ray = ray_head.connect_driver(namespace="serve-test")
    from moe_workers.serve.config import AppArgs

    path = tmp_path_factory.mktemp("ckpt")
    hf_model = make_mixtral(path, num_local_experts=NUM_EXPERTS, num_hidden_layers=NUM_LAYERS,
                            max_position_embeddings=64)
    # 4 groups; expert 0 of every layer replicated in groups 0 and 1
    placement = {}
    for g in range(4):
        experts = [f"{l}.{e}" for l in range(NUM_LAYERS) for e in range(NUM_EXPERTS) if e % 4 == g]
        if g == 1:
            experts += [f"{l}.0" for l in range(NUM_LAYERS)]
        placement[f"ExpertShard-{g}"] = experts
    args = AppArgs(model_path=str(path), served_model_name="tiny", num_groups=4, max_batch_size=8,
                   kv_cache_budget_bytes=4 * 2**20, max_queued_requests=8)
    deploy(ray_head, [serve_application("moe", "/", args, placement)])
    url = f"http://127.0.0.1:{ray_head.serve_http_port}"
    try:
        yield url, InProcessModel(path), (args, placement), hf_model
    finally:
        delete_all(ray_head)
        ray.shutdown()


def _complete(url, **body):
    return requests.post(url + "/v1/completions", json=body, timeout=120)


def test_models(served):
    url = served[0]
    data = requests.get(url + "/v1/models", timeout=30).json()
    assert data["data"][0]["id"] == "tiny" and data["data"][0]["max_model_len"] == 64


def _transformers_greedy(model, ids, n):
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def test_concurrent_clients_get_transformers_tokens(served):
    """Greedy generations through the served app equal transformers' on the same checkpoint."""
    url, reference, _, hf_model = served
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (16,), generator=g)]
    expected = [_transformers_greedy(hf_model, p, 8) for p in prompts]
    assert expected[:4] == [reference.generate([p], max_tokens=8)[0] for p in prompts[:4]]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda p: _complete(url, prompt=p, max_tokens=8, temperature=0), prompts))
    for resp, want in zip(responses, expected):
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["token_ids"][: len(want)] == want[: len(choice["token_ids"])]
        # stopped early only at EOS
        assert len(choice["token_ids"]) == 8 or choice["finish_reason"] == "stop"


def test_stream(served):
    url, reference = served[0], served[1]
    prompt = [5, 9, 11, 40]
    want = reference.generate([prompt], max_tokens=6)[0]
    resp = requests.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                        "stream": True}, stream=True, timeout=60)
    assert resp.status_code == 200
    events = [line[len("data: "):] for line in resp.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
    assert tokens == want[: len(tokens)] and json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("body,status,needle", [
    ({"prompt": [1, 2], "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": [1, 2], "temperature": -1}, 400, "temperature"),
    ({"prompt": [1, 2], "frobnicate": True}, 400, "frobnicate: unknown field"),
    ({"prompt": [1, 96]}, 400, "token id 96 is outside the vocabulary"),
    ({"prompt": [1, 2], "max_tokens": 100}, 400, "exceeds the context of 64 tokens"),
    ({"prompt": "hello"}, 400, "no tokenizer.json"),
    ({"prompt": []}, 400, "prompt is empty"),
    ({"max_tokens": 3}, 400, "prompt: Field required"),
    ({"prompt": [1, 2], "model": "other"}, 404, "not served here"),
])
def test_bad_requests_get_json_4xx(served, body, status, needle):
    url = served[0]
    resp = _complete(url, **body)
    assert resp.status_code == status, resp.text
    assert needle in resp.json()["error"]["message"]
    # the server keeps serving
    assert _complete(url, prompt=[3, 4], max_tokens=2).status_code == 200


def test_invalid_json_body(served):
    url = served[0]
    resp = requests.post(url + "/v1/completions", data=b"{not json", timeout=30,
                         headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]


def test_expert_load_recorded_per_group(served):
    from ray import serve

    url = served[0]
    assert _complete(url, prompt=[3, 4, 5, 6], max_tokens=4).status_code == 200
    statuses = [serve.get_deployment_handle(f"ExpertShard-{g}", app_name="moe").status.remote().result()
                for g in range(4)]
    total = sum(sum(s["load"].values()) for s in statuses)
    assert total > 0
    for g, s in enumerate(statuses):
        for eid in s["load"]:
            layer, expert = map(int, eid.split("."))
            assert expert % 4 == g or (g == 1 and expert == 0), f"{eid} computed by group {g}"


def test_status_profiles_the_step_and_each_experts_health(served):
    """/moe/v1/status after some decode steps: the Ingress' phases are measured and add up within
    its forward time, the exchange's parts within the exchange; the shard replicas (relayed by
    the StatusBoard) report sampled p95s per expert; moectl profile's diff and tree take it."""
    from rich.console import Console

    from moe_operator.cli.profile_view import profile_diff, profile_tree

    url = served[0]
    before = requests.get(url + "/moe/v1/status", timeout=30).json()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # enough calls that every group samples some
        codes = list(pool.map(lambda i: _complete(url, prompt=[3 + i, 4, 5], max_tokens=24).status_code, range(8)))
    assert codes == [200] * 8

    calls_before = {r["replica"]: r.get("calls", 0) for r in before["replicas"] if r.get("group")}

    def sampled():  # every replica's report since the traffic (the board relays one every 2 s)
        report = requests.get(url + "/moe/v1/status", timeout=30).json()
        shards = [r for r in report["replicas"] if r.get("group")]
        return shards and all(r.get("calls", 0) > calls_before.get(r["replica"], 0)
                              and any(h["samples"] for h in (r.get("health") or {}).values()) for r in shards) and report

    after = wait_for(sampled, timeout_s=30, what="sampled expert latencies of every replica relayed by the board")
    profile = after["ingress"]["profile"]
    phases = profile["phases"]
    assert all(phases[p] > 0 for p in ("attention", "router", "exchange", "logits", "sampling", "exchange.plan",
                                       "exchange.gather", "exchange.wait", "exchange.combine"))
    top = sum(v for p, v in phases.items() if "." not in p and p != "sampling")
    assert top <= profile["forward_s"] <= profile["step_s"]
    assert sum(v for p, v in phases.items() if p.startswith("exchange.")) <= phases["exchange"]
    health = [h for r in after["replicas"] for h in (r.get("health") or {}).values() if h["samples"]]
    assert all(h["p95_ms"] > 0 and h["errors"] == 0 for h in health)
    diff = profile_diff(before, after)
    assert diff["steps"] >= 24 and {g["group"] for g in diff["groups"]} == {f"ExpertShard-{g}" for g in range(4)}
    assert all(g["compute_ms"] > 0 for g in diff["groups"])
    console = Console(width=160, record=True)
    console.print(profile_tree(diff))
    print(console.export_text())


def test_overload_gets_503_with_retry_after_and_others_succeed(served):
    """48 requests while none can finish (shards stopped): the admission gate in Serve's proxy
    lets through what the Ingress holds (its batch and wait queue) and refuses the rest with 503 +
    Retry-After once none freed for ADMISSION_WAIT_S, before Serve's router or a replica sees them; resumed,
    every admitted request gets the reference's tokens."""
    from moe_workers.serve.config import admission_capacity
    from moe_workers.serve.proxy.gate import ADMISSION_WAIT_S

    url, reference, (args, _) = served[0], served[1], served[2]
    prompt = [7, 8, 9]
    want = reference.generate([prompt], max_tokens=40)[0]
    models = requests.get(url + "/v1/models", timeout=30)  # any answer teaches the gate the app's capacity
    assert models.status_code == 200 and "x-moe-admission" not in models.headers

    def send(_):
        r = _complete(url, prompt=prompt, max_tokens=40, temperature=0)
        return r.status_code, r
    responses = [r for _, r in flood(url, send, 48)]
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    # counted exactly, in the proxy (on failure: each answer's code, seconds and reason)
    assert codes.count(200) == admission_capacity(args), [
        (r.status_code, round(r.elapsed.total_seconds(), 2), r.text[:60] if r.status_code != 200 else "")
        for r in responses]
    for r in responses:
        assert "x-moe-admission" not in r.headers
        if r.status_code == 503:
            assert r.headers.get("Retry-After") == "1"
            assert "refused in the proxy" in r.json()["error"]["message"], r.text
            assert r.elapsed.total_seconds() >= ADMISSION_WAIT_S  # it waited in the gate for a place
        else:
            assert r.json()["choices"][0]["token_ids"] == want
    assert _complete(url, prompt=[3, 4], max_tokens=2).status_code == 200


def test_reconfigure_changes_expert_set_without_restart(served, ray_head):
    from ray import serve

    url, reference = served[0], served[1]
    shard3 = serve.get_deployment_handle("ExpertShard-3", app_name="moe")
    before = shard3.status.remote().result()
    # give group 3 extra copies of every layer's expert 2 (hosted by group 2 so far)
    args, placement = served[2]
    moved = {**placement, "ExpertShard-3": placement["ExpertShard-3"] + [f"{l}.2" for l in range(NUM_LAYERS)]}
    deploy(ray_head, [serve_application("moe", "/", args, moved)])
    wanted = {f"{l}.2" for l in range(NUM_LAYERS)}
    deadline = time.monotonic() + 60
    while not wanted <= set((after := shard3.status.remote().result())["experts"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert wanted <= set(after["experts"])
    assert after["pid"] == before["pid"], "the replica was restarted"
    # still the reference's tokens with the new placement
    prompt = [11, 12, 13, 14]
    resp = _complete(url, prompt=prompt, max_tokens=6, temperature=0)
    got = resp.json()["choices"][0]["token_ids"]
    assert got == reference.generate([prompt], max_tokens=6)[0][: len(got)]


def _greedy_logprobs(model, prompt, n):
    """The in-process model's greedy tokens and each one's logprob."""
    ids, lps = list(prompt), []
    for _ in range(n):
        lp = torch.log_softmax(model.prompt_logits(ids)[-1].double(), dim=-1)
        ids.append(int(lp.argmax()))
        lps.append(float(lp[ids[-1]]))
    return ids[len(prompt):], lps


def test_a_quarantine_applies_in_place_and_the_served_tokens_follow_it(served, ray_head):
    """spec.routing.quarantine as the operator renders it (the Ingress' user_config): the Ingress
    process stays, its routers leave the experts out (tokens and logprobs are the reference's with
    the same quarantine, and differ from the unquarantined ones), the status says so; lifted, the
    checkpoint's again."""
    url, reference = served[0], served[1]
    args, placement = served[2]
    status = lambda: requests.get(url + "/moe/v1/status", timeout=30).json()  # noqa: E731
    pid = status()["ingress"]["pid"]
    prompt, n = [21, 22, 23, 24, 25], 4
    plain = _greedy_logprobs(reference, prompt, n)
    # two experts of every layer out (a quarter of each: the default share allows it): the first
    # pair that moves this prompt's logprobs clearly (this checkpoint's experts add little to the
    # residual stream, so tokens alone might not tell)
    for pair in [(a, b) for a in range(NUM_EXPERTS) for b in range(a + 1, NUM_EXPERTS)]:
        quarantine = [f"{layer}.{e}" for layer in range(NUM_LAYERS) for e in pair]
        reference.dense.quarantine(quarantine)
        try:
            contained = _greedy_logprobs(reference, prompt, n)
        finally:
            reference.dense.quarantine([])
        if max(abs(a - b) for a, b in zip(contained[1], plain[1])) > 1e-3:
            break
    else:
        raise AssertionError("no quarantine of two experts a layer moves this prompt's logprobs")

    def served_matches(want) -> None:
        r = _complete(url, prompt=prompt, max_tokens=n, temperature=0, logprobs=1)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == want[0]
        assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], want[1])) < 1e-4

    deploy(ray_head, [serve_application("moe", "/", args, placement, quarantine=quarantine)])
    wait_for(lambda: status()["routing"]["quarantined"] == sorted(quarantine, key=lambda e: tuple(map(int, e.split(".")))),
             timeout_s=60, what="the Ingress to apply the quarantine")
    served_matches(contained)
    assert status()["ingress"]["pid"] == pid  # applied in place
    deploy(ray_head, [serve_application("moe", "/", args, placement)])
    wait_for(lambda: status()["routing"]["quarantined"] == [], timeout_s=60, what="the quarantine lifted")
    served_matches(plain)
    assert status()["ingress"]["pid"] == pid


def test_a_capacity_factor_applies_in_place_and_a_lone_request_is_routed_exactly(served, ray_head):
    """spec.routing.capacityFactor through the Ingress' user_config, in place: a single request's
    prefill (one forward call) is capped as the reference caps it, its decode steps (one token: an
    expert never takes more than one choice) route exactly; the status shows the factor."""
    url, reference = served[0], served[1]
    args, placement = served[2]
    status = lambda: requests.get(url + "/moe/v1/status", timeout=30).json()  # noqa: E731
    pid = status()["ingress"]["pid"]
    prompt, n = list(range(20, 60)), 4  # 40 tokens, 8 experts, top-2: 10 choices an expert at 1.0
    reference.dense.capacity_factor = 1.0
    try:  # the prefill's logprob (one call over the prompt, as the engine makes it), then decoding
        first_lp = float(torch.log_softmax(reference.prompt_logits(prompt)[-1].double(), dim=-1).max())
        assert sum(reference.dense.rerouted.values()) > 0  # the cap moved some of the prompt's tokens
        capped = reference.generate([prompt], max_tokens=n)[0]
    finally:
        reference.dense.capacity_factor = None
    plain_lp = float(torch.log_softmax(reference.prompt_logits(prompt)[-1].double(), dim=-1).max())
    assert abs(plain_lp - first_lp) > 5e-5  # the cap changes this prompt's first logprob (this checkpoint's experts are weak)
    deploy(ray_head, [serve_application("moe", "/", args, placement, capacity_factor=1.0)])
    wait_for(lambda: status()["routing"]["capacity_factor"] == 1.0, timeout_s=60, what="the factor applied")
    r = _complete(url, prompt=prompt, max_tokens=n, temperature=0, logprobs=1)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == capped
    assert abs(choice["logprobs"]["token_logprobs"][0] - first_lp) < 1e-5
    assert status()["routing"]["capacity_rerouted"] > 0 and status()["ingress"]["pid"] == pid
    deploy(ray_head, [serve_application("moe", "/", args, placement)])
    wait_for(lambda: status()["routing"]["capacity_factor"] is None, timeout_s=60, what="the factor unset")


@pytest.fixture(scope="module")
def served_with_tokenizer(served, ray_head, tmp_path_factory):
    """A second application on the same Ray cluster, with tokenizer.json, under its own prefix."""
    from checkpoints import add_tokenizer
    from moe_workers.serve.config import AppArgs

    path = tmp_path_factory.mktemp("ckpt-tok")
    make_mixtral(path, num_local_experts=4, num_hidden_layers=2, max_position_embeddings=64)
    add_tokenizer(path, 96)
    args = AppArgs(model_path=str(path), served_model_name="tiny-text", num_groups=2, max_batch_size=4,
                   kv_cache_budget_bytes=2**20)
    placement = {"ExpertShard-0": ["0.0", "0.1", "1.0", "1.1"], "ExpertShard-1": ["0.2", "0.3", "1.2", "1.3"]}
    first_args, first_placement = served[2]
    deploy(ray_head, [serve_application("moe", "/", first_args, first_placement),
                      serve_application("text", "/text", args, placement)])
    return served[0] + "/text", InProcessModel(path)


def test_text_prompt_with_tokenizer(served_with_tokenizer):
    url, reference = served_with_tokenizer
    from tokenizers import Tokenizer

    resp = _complete(url, prompt="w5 w17 w33 w4", max_tokens=5, temperature=0)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["token_ids"] == reference.generate([[5, 17, 33, 4]], max_tokens=5)[0][: len(choice["token_ids"])]
    tok = Tokenizer.from_file(str(reference.ckpt.path / "tokenizer.json"))
    assert choice["text"] == tok.decode(choice["token_ids"]) and choice["text"].startswith("w")
    assert requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny-text"


def test_two_apps_on_one_cluster_both_serve(served, served_with_tokenizer):
    assert _complete(served[0], prompt=[3, 4, 5], max_tokens=3).status_code == 200
    assert _complete(served_with_tokenizer[0], prompt=[3, 4, 5], max_tokens=3).status_code == 200


def test_expert_load_exported_in_prometheus_format(served, ray_head):
    """Per-expert token counts reach Ray's metrics export, where the autoscaler will scrape them."""
    url = served[0]
    assert _complete(url, prompt=[3, 4, 5, 6, 7], max_tokens=4).status_code == 200
    deadline = time.monotonic() + 90
    lines = []
    while time.monotonic() < deadline:
        text = requests.get(ray_head.metrics_url, timeout=10).text
        lines = [l for l in text.splitlines() if l.startswith("ray_moe_expert_tokens") and 'group="ExpertShard-' in l]
        if lines:
            break
        time.sleep(2)
    assert lines, "ray_moe_expert_tokens not exported"
    total = sum(float(l.rsplit(" ", 1)[1]) for l in lines)
    assert total > 0 and all('layer="' in l and 'expert="' in l for l in lines)


def _states_while_decoding(url: str, key: str, settled, what: str) -> tuple[dict, list[dict]]:
    """Batch-1 decode requests back to back until the Ingress' `channel[key]` and each shard
    replica's (4 groups) satisfy `settled`; the last status and those states, Ingress first."""
    stop = threading.Event()

    def decode():
        while not stop.is_set():
            _complete(url, prompt=[3, 4, 5], max_tokens=16)

    t = threading.Thread(target=decode)
    t.start()
    try:
        def states():
            status = requests.get(url + "/moe/v1/status", timeout=30).json()
            got = [status["channel"][key], *(r["channel"][key] for r in status["replicas"])]
            return (status, got) if all(settled(s) for s in got) and len(status["replicas"]) >= 4 else None

        return wait_for(states, timeout_s=30, what=what)
    finally:
        stop.set()
        t.join()


def test_the_cpu_wake_latency_request_is_held_while_decoding_or_its_reason_reported(served):
    """While exchanges run the ingress and every shard replica hold a PM QoS request for CPU
    wake-up latency (bound 0); where /dev/cpu_dma_latency cannot be written each says why."""
    writable = os.access("/dev/cpu_dma_latency", os.W_OK)  # the replicas run as this user, on this host
    _, got = _states_while_decoding(served[0], "wake_latency", lambda w: w["held"] or w["error"],
                                    "every replica's wake-latency request taken or refused")
    for w in got:
        assert w["limit_us"] == 0, got
        if writable:
            assert w["held"] and w["holds"] >= 1 and w["error"] == "", got
        else:
            assert not w["held"] and "/dev/cpu_dma_latency" in w["error"], got


def test_decode_steps_run_real_time_on_the_ingress_and_every_shard(served):
    """While decode steps run, the ingress' step thread and each shard replica's channel thread
    run under SCHED_RR (priority 1, the default): their status counts them, and the kernel says
    so of their threads (/proc: the replicas run on this host, as this user). No other thread of
    theirs is real-time. Where this user may not take SCHED_RR each says why instead."""
    allowed = rr_allowed()
    status, got = _states_while_decoding(served[0], "realtime", lambda r: r["threads"] >= 1 or r["error"],
                                         "every replica's step threads real-time, or refused")
    if not allowed:
        assert all(r["threads"] == 0 and "CAP_SYS_NICE" in r["error"] for r in got), got
        return
    assert all(r["priority"] == 1 and r["error"] == "" and r["threads"] >= 1 for r in got), got
    pids = [status["ingress"]["pid"], *(r["pid"] for r in status["replicas"])]
    for pid, state in zip(pids, got):
        classes = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                classes[int(tid)] = os.sched_getscheduler(int(tid)) & ~os.SCHED_RESET_ON_FORK
            except OSError:  # the thread ended
                pass
        real_time = [tid for tid, cls in classes.items() if cls == os.SCHED_RR]
        assert 1 <= len(real_time) <= state["threads"], (pid, state, classes)
        assert len(real_time) < len(classes)  # the process' other threads (event loop, metrics) are fair


def test_shard_replicas_run_on_cpus_of_their_own_while_there_are_free_ones(served):
    """Each shard replica takes a CPU no other live replica holds and runs every thread there
    (checked from /proc: the replicas run on this host); one that finds none free, or runs under
    a smaller CPU quota, says why and is left to the kernel."""
    url = served[0]
    replicas = wait_for(lambda: (r := requests.get(url + "/moe/v1/status", timeout=30).json()["replicas"])
                        and len(r) >= 4 and r, timeout_s=30, what="4 shard reports")
    held: dict[int, str] = {}
    for r in replicas:
        aff = r["cpu_affinity"]
        if aff["cpus"] is None:
            assert aff["reason"], r["group"]
            continue
        for cpu in aff["cpus"]:
            assert cpu not in held, (cpu, held[cpu], r["group"])
            held[cpu] = r["group"]
        for tid in os.listdir(f"/proc/{r['pid']}/task"):
            try:
                assert sorted(os.sched_getaffinity(int(tid))) == aff["cpus"], (r["group"], tid)
            except ProcessLookupError:
                pass  # a thread that just ended
    # the module's first app found the CPUs free (unless this host runs it under a CPU quota)
    assert held or all("quota" in r["cpu_affinity"]["reason"] for r in replicas), [r["cpu_affinity"] for r in replicas]


def test_every_shard_replica_is_on_the_expert_channel_at_rays_node_address(served):
    """The per-layer traffic goes over the expert channel: each shard replica listens on the
    address Ray registered for its node (no other interface) and the ingress knows every one;
    on one node it reaches them on their Unix sockets, the frames through shared memory."""
    import ray

    url = served[0]
    assert _complete(url, prompt=[3, 4, 5], max_tokens=3).status_code == 200
    status = requests.get(url + "/moe/v1/status", timeout=30).json()
    node_addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    members = status["channel"]["members"]
    assert sorted(members) == [f"ExpertShard-{g}" for g in range(4)]
    for group, replicas in members.items():
        assert len(replicas) == 1
        host = replicas[0]["endpoint"].rsplit(":", 1)[0]
        assert host in node_addresses, (host, node_addresses)
        assert replicas[0]["via"] == "shm", replicas  # one node: shared memory set up over the Unix sockets
    assert status["channel"]["exchanges"] >= 3 * NUM_LAYERS and status["channel"]["unavailable"] == 0
    assert status["channel"]["shm_connections"] >= 4 and status["channel"]["shm_fallbacks"] == 0, status["channel"]

    def computed_on_channel():  # replicas report every 2 s
        return sum(r["channel"]["requests"] for r in requests.get(url + "/moe/v1/status", timeout=30).json()["replicas"])

    wait_for(lambda: computed_on_channel() >= 3, timeout_s=10, what="channel requests in the replicas' reports")
    replicas = requests.get(url + "/moe/v1/status", timeout=30).json()["replicas"]
    assert all(r["channel"]["shm_connections"] >= 1 and not r["channel"]["shm_refused"] for r in replicas), \
        [r["channel"] for r in replicas]
    # each request says which of its experts the tokens chose first: the shards' RankAware policy is told
    replicas = requests.get(url + "/moe/v1/status", timeout=30).json()["replicas"]
    assert all(r["policy"]["name"] == "RankAware" for r in replicas), [r["policy"] for r in replicas]
    assert sum(r["store"]["ranked_calls"] for r in replicas) >= 3, [r["store"] for r in replicas]



def test_a_routing_surge_is_detected_and_attributed_to_the_key_that_drove_it(served, ray_head):
    """The anomaly detector on the real Ingress, thresholds as the operator renders them (user_config
    "anomaly"): a window of varied prompts is the baseline; then one key's prompts of one repeated
    token send every token to the same experts, and /moe/v1/status names the layer, the expert and
    that key's id (never the key). Put back as it was after."""
    from moe_workers.serve.auth import key_id
    url = served[0]
    args, placement = served[2]
    status = lambda: requests.get(url + "/moe/v1/status", timeout=30).json()["routing"]  # noqa: E731
    anomaly = {"warmupWindows": 1, "minTokens": 8}  # the default surge and entropy thresholds
    deploy(ray_head, [serve_application("moe", "/", args, placement, anomaly=anomaly)])
    g = torch.Generator().manual_seed(11)

    def varied() -> bool:
        _complete(url, prompt=torch.randint(3, 96, (12,), generator=g).tolist(), max_tokens=4, temperature=0)
        r = status()
        return r["detector"]["ok"] and r["detector"]["reason"] == "" and not r["anomalies"]

    wait_for(varied, timeout_s=90, interval_s=0.2, what="a routing window of varied prompts as the baseline")
    attacker = "sk-attacker-key"
    headers = {"Authorization": f"Bearer {attacker}"}

    def skewed() -> list:
        requests.post(url + "/v1/completions", json={"prompt": [7] * 40, "max_tokens": 4, "temperature": 0},
                      headers=headers, timeout=120)
        return status()["anomalies"]

    found = wait_for(skewed, timeout_s=90, interval_s=0.2, what="the detector to alert on the skewed prompts")
    assert all(a["key"] == key_id(f"Bearer {attacker}") and a["key_share"] > 0.5 for a in found), found
    assert attacker not in json.dumps(status())
    assert {a["kind"] for a in found} <= {"surge", "entropy"} and all(0 <= a["layer"] < NUM_LAYERS for a in found)
    deploy(ray_head, [serve_application("moe", "/", args, placement)])
