"""App builder arguments and the Serve config for them (no torch here: the operator imports it).

What changes often lives in each deployment's `user_config` (expert placement), `num_replicas`
and `max_queued_requests`: Serve applies those in place, without restarting replicas. Everything
in the builder's `args` is static: Serve hashes args into the app's code version, so changing them
restarts every replica. So the Ingress' replica count is not in the args of a rendered config: it
is the Ingress deployment's `num_replicas`, with the admission gate's size (`max_queued_requests`
and the capacity each Ingress replica announces, from its user_config) following it; or, for an
autoscaled Ingress, its `autoscaling_config`, with each replica announcing the capacity of the
replicas live now (each one counted by the StatusBoard).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from moe_workers.expert_ids import expert_key
from moe_workers.serve.proxy.gate import RETRY_AFTER_S

IMPORT_PATH = "moe_workers.serve.app:build_app"
INGRESS = "Ingress"
PREFIX_ROUTER = "moe_workers.serve.proxy.router:PrefixAffinityRouter"
SERVE_DEFAULT_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
KV_POLICY = "moe_workers.serve.ingress_scaling:KvAwarePolicy"
# AppArgs fields that are deployment options in a Serve config (applied in place, or restarting only
# the deployment they concern), never in the app's static args
NOT_STATIC = {"ingress_replicas", "ingress_autoscaling", "prefix_routing", "ingress_node_labels", "group_node_labels"}
AUTO = "auto"  # the Ingress' user_config ingress_replicas of an autoscaled Ingress
AUTOSCALING_METRICS_INTERVAL_S = 2.0
AUTOSCALING_LOOK_BACK_S = 10.0

# MALLOC_ARENA_MAX: glibc gives each thread that allocates (request, prefetch, maintenance, Ray's
# own) an arena and keeps freed memory in it, so a shard's resident memory crept past its tier
# budgets while serving; two arenas keep it within 1.07x budgets + baseline (bench/tiering, was 1.14).
# SETUP_HOOK_ENV: Ray runs the function this variable names in each of the app's worker processes
# before it hosts anything (what `ray.init(runtime_env={"worker_process_setup_hook": ...})` sets for a
# job; an actor's runtime environment takes the variable itself): a warm spare imports torch and
# the app's modules while it waits (moe_workers.serve.spares).
SETUP_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
RUNTIME_ENV = {"env_vars": {"MALLOC_ARENA_MAX": "2", SETUP_HOOK_ENV: "moe_workers.serve.spares.preload"}}


def group_name(index: int) -> str:
    return f"ExpertShard-{index}"


# how long the ingress polls for a small exchange's replies by default (bench/serving.py, floor.py
# and channel.py run the channel with it)
EXCHANGE_SPIN_US = 1000
# the CPU wake-up latency the channel's processes ask for while exchanges run (moe_workers.transport.wakeup):
# 0 leaves idle CPUs polling, so a woken replica runs at once
CPU_WAKE_LATENCY_US = 0
# the SCHED_RR priority of the threads on a small step's path (moe_workers.transport.realtime):
# the lowest real-time one, which preempts every fair-class task; 0 never asks
REALTIME_PRIORITY = 1


class IngressScaling(BaseModel):
    """The Ingress deployment's Serve autoscaling (spec.ingress.autoscaling): Serve's autoscaler
    keeps about `target_ongoing_requests` generation requests on each replica (and, with
    `target_kv_cache_usage`, each replica's KV cache about that full: moe_workers.serve.ingress_scaling)."""

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=4, ge=1)
    target_ongoing_requests: float | None = Field(default=None, gt=0, description="Default: the batch size.")
    target_kv_cache_usage: float | None = Field(default=None, gt=0, le=1)
    upscale_delay_s: float = Field(default=10.0, ge=0)
    downscale_delay_s: float = Field(default=120.0, ge=0)


class AppArgs(BaseModel):
    """Typed arguments of `build_app` (static for the app's lifetime)."""

    model_path: str
    family: str | None = Field(default=None, description="The model family (model_type) to compute; default: "
                               "config.json's model_type.")
    served_model_name: str = "model"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_batch_size: int = Field(default=32, ge=1)
    kv_cache_budget_bytes: int = Field(default=256 * 2**20, ge=1)
    kv_block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV cache block.")
    prefix_caching: bool = Field(default=True, description="Share computed prompt blocks between requests.")
    max_num_batched_tokens: int = Field(default=512, ge=1, le=1_048_576, description="Tokens one engine step "
                                        "computes at most: decode tokens first, then prefill chunks.")
    max_queued_requests: int = Field(default=64, ge=0)
    include_reasoning: bool = Field(default=True, description="A thinking model's reasoning goes to "
                                    "reasoning_content (a request's include_reasoning overrides it); false drops it.")
    num_groups: int = Field(ge=1)
    ingress_replicas: int = Field(default=1, ge=1)
    ingress_autoscaling: IngressScaling | None = Field(default=None, description="Serve autoscales the Ingress "
                                                       "(ingress_replicas is then ignored).")
    ingress_node_labels: dict[str, str] = Field(default_factory=dict, description="Ray node labels the Ingress "
                                                "replicas must run on (their ray_actor_options' label_selector).")
    group_node_labels: dict[str, dict[str, str]] = Field(default_factory=dict, description="Shard group -> the Ray "
                                                         "node labels its replicas must run on.")
    prefix_routing: bool = Field(default=True, description="Serve's router in the proxy sends a request to the "
                                 "Ingress replica that took its prompt's prefix before "
                                 "(moe_workers.serve.proxy.router).")
    ingress_num_cpus: float = Field(default=0.5, gt=0)
    ingress_num_gpus: float = Field(default=0.0, ge=0, description="GPUs per ingress replica: with one, the dense "
                                    "part (embeddings, attention, routers, lm_head) and the KV cache run on it.")
    shard_num_cpus: float = Field(default=0.25, gt=0)
    shard_num_gpus: float = Field(default=0.0, ge=0)
    micro_batches: int = Field(default=2, ge=1, le=8, description="Split large steps into this many concurrent "
                               "micro-batches so dense compute overlaps expert calls.")
    micro_batch_min_tokens: int = Field(default=256, ge=1, description="Steps with fewer tokens are not split "
                                        "(decode steps are dispatch-bound; extra calls would cost more than the overlap).")
    torch_threads: int = Field(default=1, ge=1, description="torch intra-op threads per shard replica.")
    pin_shard_cpus: bool = Field(default=True, description="Each shard replica runs on torch_threads CPUs no other "
                                 "shard replica on the machine holds, while there are such CPUs (else the kernel "
                                 "places it): a layer's parts then compute side by side (moe_workers.serve.cpus).")
    exchange_timeout_s: float = Field(default=30.0, gt=0, description="How long one layer's expert exchange may "
                                      "wait for the shard groups (retries on other replicas included) before the "
                                      "step's requests get a 503.")
    exchange_spin_us: int = Field(default=EXCHANGE_SPIN_US, ge=0, le=100_000, description="How long the ingress polls for "
                                  "a small exchange's replies (32 rows or fewer) before it sleeps (a sleeping thread's wake-up "
                                  "costs a round trip a third more on a VM); 0 sleeps at once. The ingress' CPU is "
                                  "busy meanwhile.")
    cpu_wake_latency_us: int = Field(default=CPU_WAKE_LATENCY_US, ge=-1, le=1_000_000, description="While "
                                     "expert exchanges run, ask the kernel to keep every CPU of the node out of "
                                     "idle states slower than this to leave (PM QoS, /dev/cpu_dma_latency: needs "
                                     "write access to it, else nothing changes and status says why); dropped 2 s "
                                     "after the last exchange. -1: never ask.")
    realtime_priority: int = Field(default=REALTIME_PRIORITY, ge=0, le=99, description="While a step "
                                   "of 32 rows or fewer runs (a decode step), the threads on its path (the ingress' "
                                   "step thread, each shard replica's channel threads) run under SCHED_RR at this "
                                   "priority, so a woken one preempts background work at once (needs CAP_SYS_NICE "
                                   "or RLIMIT_RTPRIO, else nothing changes and status says why). 0: never ask.")
    local_channel: bool = Field(default=True, description="Reach shard replicas on the ingress' own node over a "
                                "Unix socket (Linux's abstract namespace) instead of TCP loopback; TCP when that fails.")
    shared_memory_channel: bool = Field(default=True, description="Exchange frames with shard replicas reached "
                                        "on their Unix socket through a segment of shared memory (a sealed memfd "
                                        "passed over that socket after the token check) instead of the socket; "
                                        "where one cannot be made, the socket, with a log line and "
                                        "moe_channel_shm_fallbacks counting it.")
    shard_spin_us: int = Field(default=0, ge=0, le=100_000, description="After a small request (32 rows or "
                               "fewer) on a shared-memory connection, how long a shard replica polls for the next "
                               "one before it sleeps on a futex: worth it where shard replicas have CPUs of their "
                               "own (the next layer's request then needs no wake-up); on CPUs shared with the "
                               "ingress it only competes with it; a replica thread in the real-time class "
                               "(realtime_priority) keeps fair-class work off its CPU while it polls. 0: sleep at once.")
    max_request_bytes: int = Field(default=4 * 2**20, ge=1024, description="Largest HTTP request body; a larger "
                                   "one gets 413 before it is read.")
    request_body_timeout_s: float = Field(default=30.0, gt=0, description="How long a request body may take "
                                          "to arrive; then 408.")
    ingress_torch_threads: int = Field(default=1, ge=1, description="torch intra-op threads per ingress replica.")
    warm_spares: int = Field(default=1, ge=0, le=8, description="Idle worker processes, with the app's modules "
                             "imported, kept on each node that hosts shard replicas: a replacement replica starts "
                             "in one instead of a new process.")
    allowed_weight_roots: list[str] = Field(default_factory=list, description="Directories hot-swap weight "
                                            "files must lie under; none means every swap is refused.")
    placement: dict[str, list[str]] | None = Field(
        default=None,
        description="Initial placement (group -> expert ids) for `serve.run`; Serve configs carry it in "
        "each deployment's user_config instead (see serve_application).",
    )

    def group_names(self) -> list[str]:
        return [group_name(k) for k in range(self.num_groups)]

    def wake_latency_us(self) -> int | None:
        """The CPU wake-up latency the channel's processes ask for (None: never ask)."""
        return None if self.cpu_wake_latency_us < 0 else self.cpu_wake_latency_us


# Beside its batch and wait queue a replica takes this many more requests (health, models and
# metrics calls, and generations its queue then holds), so a full queue never blocks them
ADMISSION_HEADROOM = 8
# Requests that may wait in Serve's router (in the proxy) for a replica with room: as many as the
# admission gate lets in (admission_capacity), at least this many. Serve's router counts a
# request as queued while it assigns it, so a burst the gate lets through at once (up to its
# whole capacity, from idle) needs that much room even when the replicas have plenty: with a
# batch's worth (8 against a gate of 16), a full test run had one admitted request refused by
# Serve's backpressure (a plain-text 503) in such a burst. With the gate the router never holds
# more than the gate admitted; without it (a proxy not started with the gate) this is the bound.
MIN_PROXY_QUEUE = 8


# How often Serve's controller asks each replica whether it lives (Serve's default: 10 s). A
# SIGKILLed replica is only noticed at its next check, so this bounds how long a group runs one
# replica short before Serve starts the replacement; a check is one small actor call.
HEALTH_CHECK_PERIOD_S = 1.0


def admission(args: AppArgs) -> dict:
    """The Ingress' admission gate (Serve deployment options): a replica holds its batch, its
    wait queue (max_queued_requests) and the headroom; Serve's router may hold what the
    admission gate lets in (at least MIN_PROXY_QUEUE) while it assigns them; the
    proxy refuses the rest with 503 and Retry-After: 1 before any replica sees them, so refusing
    costs the proxy's HTTP handling and nothing of the replica running the model."""
    return {"max_ongoing_requests": args.max_batch_size + args.max_queued_requests + ADMISSION_HEADROOM,
            "max_queued_requests": max(MIN_PROXY_QUEUE, admission_capacity(args)),
            "backpressure_config": {"status_code": 503, "retry_after_s": RETRY_AFTER_S}}


def admission_capacity(args: AppArgs, replicas: int | None = None) -> int:
    """Generation requests the app's Ingress replicas hold together (batch + wait queue each): the
    proxy's admission gate (moe_workers.serve.proxy.gate) refuses past it, so Serve's router never
    queues requests for full replicas; the headroom stays free for health and status calls.
    `replicas`: how many run (default: the fixed count, or an autoscaled Ingress' most)."""
    if replicas is None:
        scaling = args.ingress_autoscaling
        replicas = scaling.max_replicas if scaling is not None else args.ingress_replicas
    return (args.max_batch_size + args.max_queued_requests) * max(1, replicas)


def ingress_autoscaling_config(args: AppArgs) -> dict | None:
    """The Ingress deployment's Serve `autoscaling_config` (None: a fixed replica count). Serve
    keeps about target_ongoing_requests (default: a batch) on each replica; the metrics are looked
    at every 2 s over the last 10 s, so a load step is seen within seconds (Serve's defaults, 10 s
    and 30 s, suit slower traffic). With a KV target, the policy also scales on KV cache use."""
    s = args.ingress_autoscaling
    if s is None:
        return None
    out: dict = {"min_replicas": s.min_replicas, "max_replicas": s.max_replicas, "initial_replicas": s.min_replicas,
                 "target_ongoing_requests": s.target_ongoing_requests or float(args.max_batch_size),
                 "upscale_delay_s": s.upscale_delay_s, "downscale_delay_s": s.downscale_delay_s,
                 "metrics_interval_s": AUTOSCALING_METRICS_INTERVAL_S,
                 "look_back_period_s": AUTOSCALING_LOOK_BACK_S}
    if s.target_kv_cache_usage is not None:
        out["policy"] = {"policy_function": KV_POLICY, "policy_kwargs": {"target_kv_cache_usage": s.target_kv_cache_usage}}
    return out


def _actor_options(num_cpus: float, num_gpus: float, labels: dict[str, str] | None) -> dict:
    out: dict = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if labels:
        out["label_selector"] = dict(labels)
    return out


def ingress_actor_options(args: AppArgs) -> dict:
    """The Ingress replicas' ray_actor_options: CPUs, GPUs and the Ray nodes they may run on. A
    Serve config carries them only for a pinned deployment (whole: they replace build_app's)."""
    return _actor_options(args.ingress_num_cpus, args.ingress_num_gpus, args.ingress_node_labels)


def shard_actor_options(args: AppArgs, group: str) -> dict:
    """A shard group's ray_actor_options (as ingress_actor_options)."""
    return _actor_options(args.shard_num_cpus, args.shard_num_gpus, args.group_node_labels.get(group))


def ingress_count(args: AppArgs) -> int | str:
    """What the Ingress' user_config says of its replica count: the fixed count, or AUTO (an
    autoscaled Ingress: each replica counts those live, through the StatusBoard)."""
    return AUTO if args.ingress_autoscaling is not None else args.ingress_replicas


def ingress_router_config(prefix_routing: bool) -> dict:
    """The Ingress deployment's `request_router_config`: the prefix-affinity router
    (moe_workers.serve.proxy.router), which falls back to Serve's power of two choices, or that
    one alone. Always said: a deployment option the config leaves out is build_app's."""
    return {"request_router_class": PREFIX_ROUTER if prefix_routing else SERVE_DEFAULT_ROUTER}


def engine_queue_limit(args: AppArgs) -> int:
    """Requests the Ingress' engine lets wait: all the admission gate lets in beyond the batch."""
    return args.max_queued_requests + ADMISSION_HEADROOM


def serve_application(name: str, route_prefix: str, args: AppArgs, placement: dict[str, list[str]],
                      replicas_per_group: dict[str, int] | int = 1, tiers: dict | None = None,
                      overrides: dict[str, dict] | None = None, prefetch_lookahead: int = 0,
                      shard_experts: dict[str, list[str]] | None = None,
                      api_key_digests: list[str] | None = None, quarantine: list[str] | None = None,
                      anomaly: dict | None = None, capacity_factor: float | None = None) -> dict:
    """One entry of a Serve config's `applications`. Placement, replicas, tier budgets, expert
    overrides (hot-swaps: expert -> {"path", "sha256"}), prefetch, the quarantine (experts out of
    their routers' candidates) and the expert capacity are in-place options: Serve applies them through reconfigure() /
    num_replicas without restarting replicas.

    `placement` is what the ingress routes by; `shard_experts` (default: the placement) what each
    group hosts, a superset while a new placement is applied make-before-break.
    `api_key_digests`: SHA-256 digests of the API keys /v1/* requires (none: open).
    `anomaly`: the routing anomaly detector's thresholds that differ from its defaults (in place too)."""
    # placement and the Ingress' replica count are in-place options below, not static args
    static = args.model_copy(update={"placement": None}).model_dump(exclude_none=True, exclude=NOT_STATIC)
    hosts = shard_experts if shard_experts is not None else placement
    unknown = sorted((set(placement) | set(hosts)) - set(args.group_names()))
    if unknown:
        raise ValueError(f"placement names groups outside 0..{args.num_groups - 1}: {', '.join(unknown)}")
    ingress_config: dict = {"placement": {g: list(placement.get(g, [])) for g in args.group_names()},
                            "ingress_replicas": ingress_count(args)}
    autoscaling = ingress_autoscaling_config(args)
    if prefetch_lookahead:
        ingress_config["prefetch_lookahead"] = prefetch_lookahead
    if api_key_digests:
        ingress_config["api_keys_sha256"] = sorted(api_key_digests)
    if quarantine:
        ingress_config["quarantine"] = sorted(quarantine, key=expert_key)
    if anomaly:
        ingress_config["anomaly"] = dict(anomaly)
    if capacity_factor is not None:
        ingress_config["capacity_factor"] = capacity_factor
    ingress: dict = ({"autoscaling_config": autoscaling} if autoscaling is not None
                     else {"num_replicas": args.ingress_replicas})
    ingress["request_router_config"] = ingress_router_config(args.prefix_routing)
    pinned = ingress_actor_options(args)
    if pinned.get("label_selector"):
        ingress["ray_actor_options"] = pinned
    deployments = [{"name": INGRESS, **ingress, "max_queued_requests": admission(args)["max_queued_requests"],
                    "user_config": ingress_config}]
    for g in args.group_names():
        n = replicas_per_group if isinstance(replicas_per_group, int) else replicas_per_group.get(g, 1)
        hosted = list(hosts.get(g, []))
        shard_config: dict = {"experts": hosted}
        if tiers:
            shard_config["tiers"] = dict(tiers)
        mine = {eid: dict(o) for eid, o in sorted((overrides or {}).items()) if eid in set(hosted)}
        if mine:
            shard_config["overrides"] = mine
        shard: dict = {"name": g, "num_replicas": n, "user_config": shard_config}
        pinned = shard_actor_options(args, g)
        if pinned.get("label_selector"):
            shard["ray_actor_options"] = pinned
        deployments.append(shard)
    return {"name": name, "route_prefix": route_prefix, "import_path": IMPORT_PATH, "args": static,
            "runtime_env": {"env_vars": dict(RUNTIME_ENV["env_vars"])}, "deployments": deployments}
