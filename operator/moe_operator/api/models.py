"""MoEDeployment v1alpha1: spec and status as pydantic models.

These models are the single source of truth for the API. The CRD in `crds/` is generated from
them (`python -m moe_operator.api.crd`), and a unit test fails when the two drift. Field
descriptions become `kubectl explain` text, so write them for the person reading it.
"""

from __future__ import annotations

import re
from typing import Any, Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from .types import DNS_SUBDOMAIN_PATTERN, SHA256_PATTERN, Bytes, ExpertIdStr, Quantity

GROUP = "serving.moe.io"
VERSION = "v1alpha1"
KIND = "MoEDeployment"
PLURAL = "moedeployments"
SINGULAR = "moedeployment"
SHORT_NAMES = ["moed"]
API_VERSION = f"{GROUP}/{VERSION}"


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_default=True, strict=True
    )


def cel_rules(*rules: dict[str, str]) -> ConfigDict:
    """A model's cross-field rules as the CRD's CEL `x-kubernetes-validations`: the apiserver refuses
    a manifest that breaks one with its message (Kubernetes 1.29+). The model's own validator
    checks the same rule for `moectl up`, which has no apiserver, and says the values too (a CEL
    message that formats numbers is over the apiserver's cost budget)."""
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": list(rules)})


# ---------------------------------------------------------------------------------------------
# spec.model


class ModelShape(ApiModel):
    """What the operator needs to know of the checkpoint when it cannot read its config.json
    (KubeRay: the model lives on the Ray Pods). When both are readable they must agree."""

    num_layers: int = Field(ge=1, le=1024, description="num_hidden_layers.")
    num_experts: int = Field(ge=1, le=65536, description="num_local_experts.")
    top_k: int = Field(ge=1, le=64, description="num_experts_per_tok.")
    hidden_size: int = Field(ge=1, le=1_048_576, description="hidden_size.")
    intermediate_size: int = Field(ge=1, le=4_194_304, description="intermediate_size (per expert).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="bfloat16", description="torch_dtype.")
    sparse_layers: list[Annotated[int, Field(ge=0, le=1023)]] | None = Field(
        default=None, max_length=1024,
        description="Layers with routed experts (the others run a dense MLP in the ingress), as config.json "
        "implies them (decoder_sparse_step, mlp_only_layers, first_k_dense_replace). Default: every layer.")


class ModelSource(ApiModel):
    """The checkpoint to serve."""

    path: str = Field(
        min_length=1,
        max_length=4096,
        pattern=r"^/[^\x00]*$",
        description=(
            "Absolute path, as seen by the Ray nodes, of a directory in Hugging Face layout: "
            "config.json, one or more *.safetensors files (with model.safetensors.index.json "
            "when sharded) and optionally tokenizer.json. Only safetensors are ever loaded. "
            "The path must lie under one of the operator's allowed model roots."
        ),
    )
    family: Literal["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "deepseek_v2", "gpt_oss"] | None = Field(
        default=None,
        description="Model family (a Hugging Face model_type), which fixes the weight names, the "
        "attention, the router and the expert layout. Default: config.json's model_type. Supported: "
        "mixtral, qwen3_moe, qwen2_moe, olmoe, deepseek_v3, deepseek_v2, gpt_oss; any other model_type is "
        "Ready=False with reason UnsupportedModel.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Compute dtype. auto keeps the checkpoint's torch_dtype.",
    )
    served_model_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="Name reported by GET /v1/models and expected in the request's model field. "
        "Defaults to the MoEDeployment's name.",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        le=1_048_576,
        description="Longest sequence (prompt + completion) in tokens. Defaults to the "
        "checkpoint's max_position_embeddings.",
    )
    shape: ModelShape | None = Field(
        default=None,
        description="The checkpoint's shape, for when the operator cannot read config.json "
        "(required then, for example with ray.mode KubeRay); checked against config.json when "
        "both are available.",
    )


# ---------------------------------------------------------------------------------------------
# spec.ray


RAY_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
RAY_LABEL_VALUE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"


def check_label_keys(labels: dict[str, str]) -> dict[str, str]:
    bad = [k for k in labels if not RAY_LABEL_KEY.match(k)]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a Ray node label key (an optional DNS prefix and '/', then up to "
                         "63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit)")
    return labels


# the keys are checked by the type, wherever it is used (the schema's pattern covers the values only)
RayNodeLabels = Annotated[dict[str, Annotated[str, Field(
    pattern=RAY_LABEL_VALUE, max_length=63,
    description="The label's value (empty, or up to 63 letters, digits, '-', '_', '.').")]],
    AfterValidator(check_label_keys)]


class SecretKeyRef(ApiModel):
    """A key in a Secret in the MoEDeployment's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN,
                      description="Name of the Secret.")
    key: str = Field(default="token", min_length=1, max_length=253, description="Key within the Secret.")


class KubeRayWorkerGroup(ApiModel):
    """A worker group of the RayCluster: Pods of one size whose Ray nodes carry some labels
    (KubeRay 1.5's per-group `labels`, given to `ray start --labels`), so that experts.groupNodes
    and the rayNodeLabels fields can place replicas on them."""

    name: str = Field(min_length=1, max_length=40, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
                      description="The worker group's name (KubeRay's groupName).")
    replicas: int = Field(default=1, ge=0, le=1000, description="Ray worker Pods in this group.")
    labels: RayNodeLabels = Field(default_factory=dict, description="Ray node labels of this group's nodes.")
    cpu: Quantity | None = Field(default=None, description="CPU request and limit of each Pod (default: kubeRay.workerCpu).")
    memory: Bytes | None = Field(default=None, description="Memory of each Pod (default: kubeRay.workerMemory).")
    gpus: int | None = Field(default=None, ge=0, le=16, description="nvidia.com/gpu per Pod (default: kubeRay.workerGpus).")


class KubeRayCluster(ApiModel):
    """The Ray cluster the operator creates through KubeRay (a RayService it owns)."""

    ray_version: str = Field(
        default="2.60.0", pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$", description="Ray version of the image."
    )
    image: str = Field(
        min_length=1,
        max_length=1024,
        description="Container image for head and workers; it must have moe-operator's worker "
        "package (moe_workers) installed.",
    )
    head_cpu: Quantity = Field(default="2", description="CPU request and limit of the head Pod (it runs Ray's "
                               "control processes and Serve's proxy; no replica is placed on it).")
    head_memory: Bytes = Field(default="8Gi", description="Memory request and limit of the head Pod.")
    worker_replicas: int = Field(default=1, ge=0, le=1000, description="Ray worker Pods (without workerGroups).")
    worker_cpu: Quantity = Field(default="4", description="CPU request and limit of each worker Pod.")
    worker_memory: Bytes = Field(default="16Gi", description="Memory request and limit of each worker Pod.")
    worker_gpus: int = Field(default=0, ge=0, le=16, description="nvidia.com/gpu per worker Pod.")
    allow_realtime: bool = Field(
        default=False,
        description="Add the SYS_NICE capability to the worker Pods' Ray container, so the decode step's threads "
        "may run under SCHED_RR (spec.ingress.realtimePriority). Off by default: the containers get no capability "
        "beyond the runtime's defaults, and the replicas' status says the class was not taken.",
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, max_length=64,
        description="Pod volumes (core/v1 Volume, as in a Pod spec) of the head and worker Pods: where the model "
        "checkpoint and the cold tier's disk come from (a PersistentVolumeClaim, a hostPath, ...).")
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list, max_length=64,
        description="Mounts of those volumes in the Ray container (core/v1 VolumeMount), e.g. the checkpoint at "
        "model.path's directory, read-only.")
    worker_groups: list[KubeRayWorkerGroup] = Field(
        default_factory=list, max_length=16,
        description="Worker groups, each with its own size and Ray node labels; empty: one unlabelled group "
        "'experts' of workerReplicas Pods. Every label set that experts.groupNodes or a rayNodeLabels field "
        "asks for must be carried by one of them.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    upgrade_strategy: Literal["NewCluster", "None"] | None = Field(
        default=None,
        description="KubeRay's spec.upgradeStrategy.type. NewCluster (KubeRay's default): a change to the Ray "
        "cluster (image, resources, worker groups) brings up a new RayCluster and moves the serve Service to it "
        "once the application runs there; None: the cluster is never replaced, and such a change waits. "
        "A change of the application alone is applied in place either way.")

    @field_validator("worker_groups")
    @classmethod
    def _names_once(cls, groups: list[KubeRayWorkerGroup]) -> list[KubeRayWorkerGroup]:
        seen: dict[str, int] = {}
        for i, g in enumerate(groups):
            if g.name in seen:
                raise ValueError(f"entry [{i}] names worker group {g.name} again (first at [{seen[g.name]}])")
            seen[g.name] = i
        return groups

    def node_label_sets(self) -> list[tuple[str, dict[str, str]]]:
        """(worker group name, its Ray node labels) for every worker group rendered."""
        if not self.worker_groups:
            return [("experts", {})]
        return [(g.name, dict(g.labels)) for g in self.worker_groups]


class RayTarget(ApiModel):
    """Where the Serve application runs."""

    model_config = cel_rules(
        {"rule": "self.mode != 'KubeRay' || has(self.kubeRay)",
         "message": "ray.kubeRay is required when ray.mode is KubeRay", "fieldPath": ".kubeRay"},
        {"rule": "self.mode != 'KubeRay' || !has(self.authTokenSecretRef) || self.authTokenSecretRef.key == 'auth_token'",
         "messageExpression": "'ray.authTokenSecretRef.key: KubeRay reads the Ray token from the key auth_token of "
                              "Secret ' + self.authTokenSecretRef.name + ', not \\'' + self.authTokenSecretRef.key + "
                              "'\\'; store it there and set key: auth_token'",
         "fieldPath": ".authTokenSecretRef.key"},
    )

    mode: Literal["Existing", "KubeRay"] = Field(
        default="Existing",
        description="Existing: deploy onto a running Ray cluster through its dashboard REST API "
        "(address below, or the operator's default). KubeRay: the operator owns a RayService "
        "(ray.io/v1) whose serveConfigV2 is the rendered application.",
    )
    address: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s/]+(:[0-9]{1,5})?/?$",
        description="Dashboard URL of an existing Ray cluster, for example http://ray-head:8265. "
        "Defaults to the operator's --ray-address setting; in standalone mode a local Ray head is "
        "started when neither is set. Only used with mode Existing.",
    )
    auth_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret holding the Ray token. Mode Existing: sent to the dashboard as "
        "x-ray-authorization: Bearer <token> (Ray enables token authentication by default). Mode "
        "KubeRay: rendered as rayClusterConfig.authOptions (mode token, this Secret), so every Ray "
        "Pod uses it; KubeRay reads the key auth_token, so key must be auth_token there.",
    )
    kube_ray: KubeRayCluster | None = Field(
        default=None, description="Cluster settings used with mode KubeRay (required there)."
    )

    @model_validator(mode="after")
    def _kuberay_needs_cluster(self) -> "RayTarget":
        if self.mode == "KubeRay" and self.kube_ray is None:
            raise ValueError("ray.kubeRay is required when ray.mode is KubeRay")
        ref = self.auth_token_secret_ref
        if self.mode == "KubeRay" and ref is not None and ref.key != "auth_token":
            raise ValueError(f"ray.authTokenSecretRef.key: KubeRay reads the Ray token from the key auth_token of "
                             f"Secret {ref.name}, not '{ref.key}'; store it there and set key: auth_token")
        return self


# ---------------------------------------------------------------------------------------------
# spec.ingress


class IngressAutoscaling(ApiModel):
    """Ray Serve's autoscaler for the Ingress deployment, applied in place (no replica restarts):
    each replica it adds joins the expert channel, and the admission gate counts its capacity.
    minReplicas above maxReplicas: refused by the apiserver (a CEL rule) naming both."""

    model_config = cel_rules(
        {"rule": "self.minReplicas <= self.maxReplicas", "fieldPath": ".minReplicas",
         "message": "ingress.autoscaling.minReplicas is above maxReplicas"},
    )

    min_replicas: int = Field(default=1, ge=1, le=64, description="Fewest Ingress replicas (the count it starts with).")
    max_replicas: int = Field(default=4, ge=1, le=64, description="Most Ingress replicas.")
    target_ongoing_requests: float | None = Field(
        default=None, gt=0, le=100_000,
        description="Generation requests each replica should hold (running and waiting); Serve adds replicas "
        "when the average is above it and removes them when below. Default: maxBatchSize.")
    target_kv_cache_usage: float | None = Field(
        default=None, gt=0, le=1,
        description="Also scale so each replica's KV cache is about this full (0-1): long contexts fill a "
        "replica's cache before its request count says so. Unset: requests only.")
    upscale_delay_seconds: float = Field(default=10.0, ge=0, le=3600,
                                         description="How long load must call for more replicas before one is added.")
    downscale_delay_seconds: float = Field(default=120.0, ge=0, le=86_400,
                                           description="How long load must call for fewer replicas before one is removed.")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "IngressAutoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"ingress.autoscaling.minReplicas ({self.min_replicas}) is above "
                             f"maxReplicas ({self.max_replicas})")
        return self


class IngressSpec(ApiModel):
    """The Ingress deployment: HTTP API, batching, embeddings, attention, routers, lm_head."""

    replicas: int = Field(default=1, ge=1, le=64, description="Ingress replicas (ignored with autoscaling).")
    ray_node_labels: RayNodeLabels = Field(
        default_factory=dict, description="Ray node labels the Ingress replicas must run on (`ray start --labels`).")
    autoscaling: IngressAutoscaling | None = Field(
        default=None, description="Let Ray Serve scale the Ingress on load, between minReplicas and maxReplicas.")
    prefix_routing: bool = Field(
        default=True,
        description="Send a request to the Ingress replica that took the same prompt prefix before (its prefix "
        "cache holds it), unless that replica is much busier than another; false: Serve's default, the less "
        "loaded of two random replicas. Needs the admission gate in Serve's proxy (moectl up and the "
        "project's Ray image set it); without it requests are routed by load.",
    )
    num_cpus: float = Field(default=1.0, gt=0, le=512, description="CPUs reserved per replica (Ray num_cpus; fractions allowed).")
    num_gpus: float = Field(default=0.0, ge=0, le=16, description="GPUs reserved per replica (Ray num_gpus; fractions "
                            "allowed). With one, the dense part (embeddings, attention, routers, lm_head) and the KV "
                            "cache run on it (not yet run on a GPU).")
    route_prefix: str = Field(
        default="/",
        pattern=r"^/[A-Za-z0-9._~/-]*$",
        max_length=256,
        description="HTTP route prefix of the application on the Ray Serve proxy; give each "
        "MoEDeployment sharing one Ray cluster its own prefix.",
    )
    max_batch_size: int = Field(
        default=32, ge=1, le=4096, description="Most sequences sharing one decode step (continuous batching)."
    )
    kv_cache_budget: Bytes = Field(
        default="1Gi",
        description="Memory the KV cache may use per replica, as blocks of kvBlockSize tokens: a sequence holds "
        "the blocks its tokens fill (sliding-window layers their window only), not a whole maxModelLen. Must "
        "hold one maxModelLen sequence. Requests wait when it is full; a running sequence that needs a block "
        "when none is free preempts the most recently admitted one, which is recomputed later.",
    )
    kv_block_size: int = Field(
        default=16, ge=1, le=1024,
        description="Tokens per KV cache block: the unit of allocation and of prefix sharing.",
    )
    prefix_caching: bool = Field(
        default=True,
        description="Reuse computed KV blocks between requests whose prompts start with the same tokens "
        "(a chat's system prompt and history); blocks nobody holds are evicted least recently used. A "
        "committed hot-swap invalidates what was cached before it.",
    )
    max_num_batched_tokens: int = Field(
        default=512, ge=1, le=1_048_576,
        description="Tokens one engine step computes at most: every running sequence's decode token first, then "
        "prefill chunks that fit, so a long prompt is prefilled over several steps while running streams go on.",
    )
    max_queued_requests: int = Field(
        default=64,
        ge=0,
        le=100_000,
        description="Requests a replica lets wait for a place in its batch (or KV cache space); "
        "beyond them (and a few in flight) the Ray Serve proxy refuses requests with 503 and "
        "Retry-After: 1 before they reach a replica.",
    )
    include_reasoning: bool = Field(
        default=True,
        description="For a model that thinks (think tags, gpt-oss' analysis channel), chat answers carry the "
        "thinking as message.reasoning_content (streamed as delta.reasoning_content) and only the answer as "
        "content; false drops the thinking. A request's include_reasoning overrides this default.",
    )
    max_request_bytes: Bytes = Field(
        default="4Mi",
        description="Largest HTTP request body the API accepts; a larger one gets 413 before it is read.",
    )
    cpu_wake_latency_microseconds: int = Field(
        default=0, ge=-1, le=1_000_000,
        description="While expert exchanges run, the app's replicas (Ingress and shards) ask each node's "
        "kernel to keep its CPUs out of idle states slower than this to leave (PM QoS on "
        "/dev/cpu_dma_latency, dropped 2 s after the last exchange): a woken replica then runs at once "
        "instead of waiting for a halted CPU. 0 leaves idle CPUs polling; -1 never asks. Needs write access "
        "to the device in the Ray containers (else it is not taken and the replicas' status says why); it "
        "changes the whole node's power management while held.",
    )
    realtime_priority: int = Field(
        default=1, ge=0, le=99,
        description="While a decode step runs (a step of 32 rows or fewer: tokens x topK), the threads on its "
        "path (the Ingress' step thread, each shard replica's channel threads) run under SCHED_RR at this "
        "priority, so a woken one preempts background work (Ray's daemons, metrics) at once instead of waiting "
        "for its turn; larger steps run in the fair class. Needs CAP_SYS_NICE (or RLIMIT_RTPRIO) in the Ray "
        "containers, else it is not taken and the replicas' status says why. 0 never asks.",
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="API keys for /v1/*: a Secret key holding one key per line. With keys set, every "
        "request needs Authorization: Bearer <key> (401 otherwise). The replicas get only SHA-256 "
        "digests, applied in place (no restart). Needs the chart's readTokenSecrets.",
    )


# ---------------------------------------------------------------------------------------------
# spec.experts


class HotTier(ApiModel):
    """Accelerator memory (host memory in compute layout when there is no accelerator)."""

    budget: Bytes = Field(description="Bytes of expert weights kept ready to compute, per replica.")


class WarmTier(ApiModel):
    """Host RAM."""

    budget: Bytes = Field(description="Bytes of expert weights kept in host RAM, per replica.")
    pinned: bool = Field(default=True, description="Use pinned (page-locked) memory when CUDA is present.")


class ColdTier(ApiModel):
    """Local NVMe cache of safetensors files, read lazily per expert (mmap)."""

    path: str = Field(
        default="/var/cache/moe-experts",
        pattern=r"^/[^\x00]*$",
        max_length=4096,
        description="Absolute path of the cache directory on each Ray node.",
    )
    budget: Bytes | None = Field(
        default=None, description="Most bytes the cache may hold per node; unset means unbounded."
    )


class PrefetchSpec(ApiModel):
    """Router-guided prefetch."""

    enabled: bool = Field(default=True, description="Promote experts the ingress says it will call next.")
    lookahead_layers: int = Field(
        default=1, ge=0, le=8, description="Layers ahead whose experts are predicted and prefetched."
    )


class TierSpec(ApiModel):
    """Where each replica keeps its experts, with byte budgets per tier."""

    hot: HotTier = Field(description="Hot tier: experts ready to compute.")
    warm: WarmTier = Field(description="Warm tier: host RAM.")
    cold: ColdTier = Field(default_factory=ColdTier, description="Cold tier: local NVMe cache directory.")
    policy: Literal["RankAware", "RecencyFrequency", "LRU", "LFU"] = Field(
        default="RankAware",
        description="Eviction and promotion policy. RankAware keeps the experts most likely at their layer's "
        "next call, from recency, frequency and the router's ranking (a token's first choice tends to come "
        "again); RecencyFrequency weighs recency and frequency; LRU and LFU use one of them.",
    )
    idle_demotion_seconds: int = Field(
        default=300, ge=0, le=86_400,
        description="An expert unused this long moves down one tier; 0 disables idle demotion.",
    )
    prefetch: PrefetchSpec = Field(default_factory=PrefetchSpec, description="Router-guided prefetch.")


class WeightsSource(ApiModel):
    """A safetensors file holding one expert's tensors."""

    path: str = Field(
        min_length=1, max_length=4096, pattern=r"^/[^\x00]*\.safetensors$",
        description="Absolute path of a .safetensors file with one routed expert's tensors, under "
        "the names the checkpoint uses for it or short ones: w1.weight, w2.weight, w3.weight (mixtral); "
        "gate_proj.weight, up_proj.weight, down_proj.weight (qwen3_moe, qwen2_moe, olmoe, deepseek_v3); "
        "gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias (gpt_oss). Must lie under one of "
        "the operator's allowed weight roots.",
    )
    sha256: str | None = Field(
        default=None, pattern=SHA256_PATTERN,
        description="Expected sha256 of the file (64 lowercase hex digits); the swap is refused "
        "when it differs.",
    )


class ExpertOverride(ApiModel):
    """Replace one expert's weights (hot-swap). Removing the entry rolls back."""

    expert: ExpertIdStr = Field(description="Expert id LAYER.EXPERT, for example 3.12.")
    weights: WeightsSource = Field(description="The new weights.")


class GroupNodes(ApiModel):
    """Shard groups pinned to the Ray nodes that carry some labels."""

    groups: list[Annotated[int, Field(ge=0, le=1023)]] = Field(
        min_length=1, max_length=1024, description="Shard group indices (0 .. groups-1), each once.",
        json_schema_extra={"x-kubernetes-list-type": "set"})
    ray_node_labels: RayNodeLabels = Field(
        min_length=1, description="Ray node labels (`ray start --labels k=v`; KubeRay: the worker group's "
        "rayStartParams labels) these groups' replicas must run on; each label must match.")


class ExpertsSpec(ApiModel):
    """The ExpertShard deployments: how experts are split, replicated and stored. A group pinned
    twice across groupNodes entries is refused by the operator (Ready=False, InvalidSpec): that
    check does not fit the apiserver's CEL cost budget; the range of each index and repeats within
    one entry are the schema's."""

    model_config = cel_rules(
        {"rule": "!has(self.groupNodes) || self.groupNodes.all(e, e.groups.all(g, g < self.groups))",
         "fieldPath": ".groupNodes",
         "message": "experts.groupNodes names a group that does not exist: the groups are 0 .. experts.groups - 1"},
    )

    groups: int = Field(
        default=4, ge=1, le=1024,
        description="Number of shard groups (ExpertShard deployments). Each hosts a subset of "
        "the experts of every layer.",
    )
    replicas_per_group: int = Field(
        default=1, ge=0, le=256,
        description="Replicas of each shard group. The scale subresource (kubectl scale, HPA) "
        "sets this field; the autoscaler respects it.",
    )
    num_cpus: float = Field(default=1.0, gt=0, le=512, description="CPUs reserved per shard replica (Ray num_cpus).")
    num_gpus: float = Field(default=0.0, ge=0, le=16, description="GPUs reserved per shard replica (Ray num_gpus). "
                            "With one, the hot tier lives on it and warm memory is pinned (not yet run on a GPU).")
    pin_cpus: bool = Field(
        default=True,
        description="Each shard replica runs all its threads on CPUs of its own: one no other shard replica on the "
        "machine holds (of those its container may use), while there are such CPUs; else the kernel places it. "
        "A decode layer's parts on two groups then compute side by side instead of queueing on one CPU. The "
        "replicas' status shows what each took (cpu_affinity). false leaves placement to the kernel.",
    )
    warm_spares: int = Field(
        default=1, ge=0, le=8,
        description="Idle Ray worker processes, with torch and the app's code already imported, kept "
        "on each node that hosts shard replicas: a replica Serve replaces starts in one (seconds) "
        "instead of a new process. 0 turns them off; each costs the memory of one idle process.",
    )
    ray_node_labels: RayNodeLabels = Field(
        default_factory=dict, description="Ray node labels every shard replica must run on (groupNodes "
        "overrides it per group). A group no live Ray node can take: Ready=False (Unschedulable) naming it.")
    group_nodes: list[GroupNodes] = Field(
        default_factory=list, max_length=64,
        description="Pin shard groups to Ray nodes by label, so groups spread over nodes as the user wants "
        "(each group at most once). Changing a group's pin restarts that group's replicas only.")
    tiers: TierSpec = Field(description="Byte budgets and policy of the hot, warm and cold tiers.")
    overrides: list[ExpertOverride] = Field(
        default_factory=list, max_length=4096,
        description="Experts whose weights replace the checkpoint's (hot-swap), at most one "
        "entry per expert.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["expert"]},
    )

    @field_validator("group_nodes")
    @classmethod
    def _groups_exist_once(cls, entries: list[GroupNodes], info) -> list[GroupNodes]:
        groups, first = info.data.get("groups"), {}
        for i, entry in enumerate(entries):
            for g in entry.groups:
                if groups is not None and not 0 <= g < groups:
                    raise ValueError(f"entry [{i}] names group {g}; the groups are 0..{groups - 1}")
                if g in first:
                    raise ValueError(f"entry [{i}] pins group {g} again (first at [{first[g]}])")
                first[g] = i
        return entries

    def node_labels(self) -> dict[int, dict[str, str]]:
        """Each pinned group's Ray node labels (groupNodes over rayNodeLabels)."""
        out = {g: dict(self.ray_node_labels) for g in range(self.groups)} if self.ray_node_labels else {}
        for entry in self.group_nodes:
            for g in entry.groups:
                out[g] = dict(entry.ray_node_labels)
        return out

    @field_validator("overrides")
    @classmethod
    def _one_override_per_expert(cls, overrides: list[ExpertOverride]) -> list[ExpertOverride]:
        first: dict[str, int] = {}
        for i, o in enumerate(overrides):
            if o.expert in first:
                raise ValueError(f"entry [{i}] overrides expert {o.expert} again (first at [{first[o.expert]}])")
            first[o.expert] = i
        return overrides


# ---------------------------------------------------------------------------------------------
# spec.routing


class AnomalySpec(ApiModel):
    """When the Ingress' routing anomaly detector alerts (condition RoutingAnomaly, an Event, the
    moe_routing_anomaly gauge). Per MoE layer it keeps each expert's baseline share of the layer's
    expert-tokens, a moving mean over the routing windows (5 s) that saw traffic."""

    entropy_floor: float = Field(
        default=0.5, ge=0.0, le=1.0,
        description="Alert when a layer's routing entropy, as a fraction of log(experts) (1.0: every expert used "
        "alike, 0: one expert takes every token), falls below this.")
    surge_factor: float = Field(
        default=3.0, gt=1.0, le=1000.0,
        description="Alert when an expert's share of its layer's expert-tokens exceeds this many times its baseline "
        "share (3.0: a surge of more than 200%).")
    min_share_factor: float = Field(
        default=2.0, ge=1.0, le=1000.0,
        description="A surge counts only when the expert's share is at least this many times the uniform share "
        "1/experts (a rarely used expert going from 1 token to 3 does not alert).")
    min_tokens: int = Field(
        default=64, ge=1, le=1_000_000_000,
        description="A layer's expert-tokens a window needs to be compared or learnt from.")
    warmup_windows: int = Field(
        default=3, ge=1, le=10_000,
        description="Windows of baseline a layer needs before it may alert.")

    def user_config(self) -> dict:
        """The settings that differ from the defaults, as the Ingress' user_config "anomaly" spells them."""
        return self.model_dump(by_alias=True, exclude_defaults=True)


class RoutingSpec(ApiModel):
    """What the routers may choose: experts contained (quarantined) out of their layer's candidates,
    and an opt-in cap on the tokens an expert takes a step."""

    quarantine: list[ExpertIdStr] = Field(
        default_factory=list, max_length=4096,
        description="Experts LAYER.EXPERT taken out of their router's candidates: their tokens take their next "
        "choice, weighted as the family's router weights it. Applied in place (no replica restarts; the prefix "
        "cache is dropped). Remove an entry to lift it.",
        json_schema_extra={"x-kubernetes-list-type": "set"})
    max_quarantined_share: float = Field(
        default=0.25, gt=0.0, le=0.5,
        description="The most of a layer's routed experts that may be quarantined at once.")
    anomaly: AnomalySpec = Field(default_factory=AnomalySpec,
                                 description="When the routing anomaly detector alerts (condition RoutingAnomaly).")
    auto_quarantine: bool = Field(
        default=False,
        description="Quarantine the expert a RoutingAnomaly surge names, on top of spec.routing.quarantine "
        "(status.autoQuarantined), never past maxQuarantinedShare of its layer. Lifted when this is turned off or "
        "the expert is put in spec.routing.quarantine (then moectl quarantine --lift lifts it).")
    capacity_factor: float | None = Field(
        default=None, ge=1.0, le=16.0,
        description="Opt-in expert capacity: in each forward call (a step, or each micro-batch of a long one) "
        "an expert takes at most factor x tokens x top_k / experts of the tokens' choices; a choice that finds "
        "its expert full goes to the token's next-best expert with room (GShard's rule), weighted as the "
        "family's router weights the new set. Unset: every token gets its exact choice (outputs as the "
        "model's). At least 1.0, so that no choice is ever dropped. Applied in place.")

    @field_validator("quarantine")
    @classmethod
    def _each_expert_once(cls, experts: list[str]) -> list[str]:
        first: dict[str, int] = {}
        for i, e in enumerate(experts):
            if e in first:
                raise ValueError(f"entry [{i}] quarantines expert {e} again (first at [{first[e]}])")
            first[e] = i
        return experts


# ---------------------------------------------------------------------------------------------
# spec.autoscaling


class MetricsSource(ApiModel):
    """Where the autoscaler reads per-expert load."""

    model_config = cel_rules(
        {"rule": "self.source != 'Prometheus' || has(self.prometheusUrl)", "fieldPath": ".prometheusUrl",
         "message": "metrics.prometheusUrl is required when metrics.source is Prometheus"},
    )

    source: Literal["Direct", "Prometheus"] = Field(
        default="Direct",
        description="Direct scrapes the Ray metrics endpoints; Prometheus queries a Prometheus "
        "server's HTTP API (PromQL).",
    )
    prometheus_url: str | None = Field(
        default=None, pattern=r"^https?://\S+$",
        description="Prometheus base URL, required with source Prometheus.",
    )
    scrape_urls: list[Annotated[str, Field(pattern=r"^https?://\S+$")]] = Field(
        default_factory=list, max_length=1024,
        description="Direct: the Ray nodes' metrics export URLs (http://NODE:PORT/metrics). Empty: the "
        "application's own load report through its endpoint (GET <routePrefix>/moe/v1/status).",
    )
    scrape_interval_seconds: int = Field(default=15, ge=1, le=3600, description="How often load is read.")

    @model_validator(mode="after")
    def _prometheus_needs_url(self) -> "MetricsSource":
        if self.source == "Prometheus" and not self.prometheus_url:
            raise ValueError("metrics.prometheusUrl is required when metrics.source is Prometheus")
        return self


class AutoscalingSpec(ApiModel):
    """React to how the experts are actually used: replicate, move, and scale."""

    model_config = cel_rules(
        {"rule": "self.minReplicasPerGroup <= self.maxReplicasPerGroup", "fieldPath": ".minReplicasPerGroup",
         "message": "autoscaling.minReplicasPerGroup is above maxReplicasPerGroup"},
    )

    mode: Literal["Off", "Recommend", "Auto"] = Field(
        default="Off",
        description="Off: no decisions. Recommend: write the plan into status only. Auto: apply it.",
    )
    imbalance_threshold: float = Field(
        default=1.25, ge=1.0, le=100.0,
        description="Rebalance when max/mean shard-group load stays above this value.",
    )
    window_seconds: int = Field(default=60, ge=5, le=86_400, description="Window over which load is averaged.")
    stabilization_window_seconds: int = Field(
        default=120, ge=0, le=86_400,
        description="Imbalance must last this long before a decision is taken.",
    )
    cooldown_seconds: int = Field(default=300, ge=0, le=86_400, description="Least time between two applied decisions.")
    max_moves_per_step: int = Field(default=8, ge=1, le=10_000, description="Most expert copies added or moved by one decision.")
    redundant_expert_slots: int = Field(
        default=0, ge=0, le=65_536,
        description="Extra expert copies per MoE layer (over one per expert) the planner may place to replicate "
                    "hot experts. Every shard group gets (experts + this) / groups expert slots per layer.",
    )
    min_replicas_per_group: int = Field(default=1, ge=0, le=256, description="Fewest replicas per shard group.")
    max_replicas_per_group: int = Field(default=4, ge=1, le=256, description="Most replicas per shard group.")
    target_tokens_per_second_per_replica: float | None = Field(
        default=None, gt=0,
        description="Scale replicas so each serves about this many expert-tokens per second; "
        "unset disables replica scaling on load.",
    )
    metrics: MetricsSource = Field(default_factory=MetricsSource, description="Where load is read.")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "AutoscalingSpec":
        if self.min_replicas_per_group > self.max_replicas_per_group:
            raise ValueError(
                f"autoscaling.minReplicasPerGroup ({self.min_replicas_per_group}) is above "
                f"maxReplicasPerGroup ({self.max_replicas_per_group})"
            )
        return self


# ---------------------------------------------------------------------------------------------
# spec


class MoEDeploymentSpec(ApiModel):
    """Desired state of a MoEDeployment: a Mixture-of-Experts model served on Ray Serve with
    expert parallelism."""

    model: ModelSource = Field(description="The checkpoint to serve.")
    ray: RayTarget = Field(default_factory=RayTarget, description="The Ray cluster the application runs on.")
    ingress: IngressSpec = Field(default_factory=IngressSpec, description="The Ingress deployment (dense part, HTTP API).")
    experts: ExpertsSpec = Field(description="Expert shard groups, tiers and overrides.")
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec, description="Load-aware rebalancing and scaling."
    )
    routing: RoutingSpec = Field(default_factory=RoutingSpec,
                                 description="What the routers may choose (quarantine, expert capacity).")

    @model_validator(mode="after")
    def _pins_have_worker_groups(self) -> "MoEDeploymentSpec":
        """Mode KubeRay: the operator writes the RayCluster, so every label set a pin asks for must
        be some worker group's (the labels of a group include the pin's), or no node could ever take
        those replicas."""
        if self.ray.mode != "KubeRay" or self.ray.kube_ray is None:
            return self
        wanted = [(f"experts.groupNodes[{i}]", e.ray_node_labels) for i, e in enumerate(self.experts.group_nodes)]
        wanted += [(field, labels) for field, labels in (("experts.rayNodeLabels", self.experts.ray_node_labels),
                                                         ("ingress.rayNodeLabels", self.ingress.ray_node_labels)) if labels]
        groups = self.ray.kube_ray.node_label_sets()
        for field, labels in wanted:
            if not any(all(have.get(k) == v for k, v in labels.items()) for _, have in groups):
                offered = "; ".join(f"{n}: {have or 'no labels'}" for n, have in groups)
                raise ValueError(f"{field} asks for Ray node labels {labels}, which no worker group of "
                                 f"ray.kubeRay.workerGroups carries ({offered})")
        return self


# ---------------------------------------------------------------------------------------------
# status


class Condition(ApiModel):
    """A Kubernetes-style condition."""

    type: str = Field(description="Ready, Progressing or Degraded.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason code.")
    message: str = Field(default="", description="Human-readable detail.")
    observed_generation: int | None = Field(default=None, description="Spec generation the condition was computed for.")
    last_transition_time: str | None = Field(default=None, description="When status last changed (RFC 3339).")


class GroupStatus(ApiModel):
    """One shard group as observed."""

    name: str = Field(description="Deployment name, ExpertShard-<k>.")
    replicas: int = Field(default=0, description="Desired replicas.")
    ready_replicas: int = Field(default=0, description="Replicas running.")
    experts: int = Field(default=0, description="Expert copies hosted.")
    load: float | None = Field(default=None, description="Expert-tokens per second over the autoscaling window.")


class TierSummary(ApiModel):
    """Aggregated residency of one tier across replicas."""

    experts: int = Field(default=0, description="Expert copies resident.")
    bytes: int = Field(default=0, description="Bytes resident.")
    form: str | None = Field(default=None, description="How the tier holds an expert: compute (the compute dtype "
                             "the kernels read) or stored (a quantized checkpoint's own form: fp8 and its scales, "
                             "mxfp4 blocks and scales).")
    expert_bytes: int | None = Field(default=None, description="Bytes of one expert as this tier holds it.")
    vs_compute: float | None = Field(default=None, description="expertBytes over one expert in the compute dtype "
                                     "(0.5 for fp8 against bf16; about 0.27 for mxfp4).")
    decoder: str | None = Field(default=None, description="Hot tier of a quantized model: what decodes an expert "
                                "into a hot slot. native (ISA): the C decoder built on the node; torch (why not "
                                "native, e.g. no C compiler): the same bits, several times slower; cuda: the "
                                "accelerator.")


class SwapRecord(ApiModel):
    """One hot-swap as it happened."""

    expert: str = Field(description="Expert id.")
    digest: str = Field(default="", description="Content digest of the new version.")
    outcome: Literal["Pending", "Serving", "Failed", "RolledBack"] = Field(description="Result.")
    reason: str = Field(default="", description="Why it failed, when it did.")
    started_at: str | None = Field(default=None, description="When the swap was requested.")
    duration_seconds: float | None = Field(default=None, description="Stage + validate + commit time on the slowest replica.")


class LayerImbalance(ApiModel):
    """One MoE layer's balance."""

    layer: int = Field(description="Layer index.")
    imbalance: float = Field(description="max/mean shard-group load of this layer.")


class RoutingAnomalyRecord(ApiModel):
    """One alert of the Ingress' routing anomaly detector."""

    expert: ExpertIdStr = Field(description="LAYER.EXPERT: the surging expert, or (entropy) the layer's most chosen.")
    kind: Literal["surge", "entropy"] = Field(description="surge: the expert's share over surgeFactor x its baseline; "
                                              "entropy: the layer's routing entropy under entropyFloor.")
    key: str = Field(description="Id of the API key with the most of the expert's tokens (the first 8 hex of its "
                     "SHA-256; '-' for requests without a key).")
    since: str | None = Field(default=None, description="When the detector first saw it.")


class AutoscalingStatus(ApiModel):
    """The autoscaler's last decision, the placement it is applying, and its own memory (so a
    restarted operator keeps the stabilization window and cooldown)."""

    last_decision: str = Field(default="", description="What was decided: None, Rebalance, ScaleUp, ScaleDown.")
    reason: str = Field(default="", description="Why.")
    message: str = Field(default="", description="What the autoscaler sees now: why nothing is done, or what is.")
    imbalance_before: float | None = Field(default=None, description="Imbalance (see status.imbalance) before.")
    imbalance_after: float | None = Field(default=None, description="Imbalance the planner expects after.")
    time: str | None = Field(default=None, description="When (RFC 3339).")
    moved_copies: int | None = Field(default=None, description="Expert copies the plan loads where they were not.")
    bytes_moved: int | None = Field(default=None, description="Bytes the plan loads.")
    phase: str = Field(default="Steady", description="Steady, or where a placement change is: Loading (new copies "
                       "beside the old), Switching (routing moved to the new copies), Draining (old copies dropped).")
    target: dict[str, list[str]] | None = Field(
        default=None, description="The placement being applied (shard group -> expert ids), until it is.")
    recommended: dict[str, list[str]] | None = Field(
        default=None, description="mode Recommend: the placement a rebalance would apply.")
    switched_at: str | None = Field(default=None, description="When routing moved to the target (RFC 3339).")
    above_since: str | None = Field(default=None, description="Imbalance above the threshold continuously since.")
    last_applied: str | None = Field(default=None, description="When a decision was last applied (cooldown).")
    last_set_replicas: int | None = Field(default=None, description="Replicas per group the autoscaler last wrote.")
    last_request: str | None = Field(default=None, description="The last `moectl rebalance` request handled.")
    coefficient_of_variation: float | None = Field(default=None, description="Of group load over the window.")
    tokens_per_second: float | None = Field(default=None, description="Expert-tokens per second, all groups.")
    slots_per_group: int | None = Field(
        default=None, description="Expert slots every shard group has per layer: (experts + redundantExpertSlots) / groups.")


class KVCacheStatus(ApiModel):
    """The Ingress' paged KV cache, as the replica that answered the observation reports it."""

    block_size: int = Field(description="Tokens per block (spec.ingress.kvBlockSize).")
    blocks_total: int = Field(description="Blocks the budget holds.")
    blocks_used: int = Field(description="Blocks held by running sequences now.")
    max_sequence_tokens: int = Field(description="Longest sequence (prompt + completion) a request may ask for.")
    prefix_hit_rate: float | None = Field(default=None, description="Prompt tokens found computed in the prefix "
                                          "cache over prompt tokens looked up, since the replica started.")
    preemptions: int = Field(default=0, description="Sequences preempted for blocks (recomputed later), since start.")
    chunked_prefills: int = Field(default=0, description="Prompts prefilled over more than one step, since start.")
    attention: str | None = Field(default=None, description="How decode reads the cache on that replica: flex "
                                  "(FlexAttention over the blocks, the GPU's path) or gather (copies, the CPU's); "
                                  "flex that failed reads 'gather (flex failed: why)'.")


class ApiKeysStatus(ApiModel):
    """The API keys in force (never the keys: a count and a fingerprint of their digests)."""

    count: int = Field(description="Keys accepted.")
    fingerprint: str = Field(description="First 16 hex digits of the SHA-256 of the keys' sorted SHA-256 digests.")


class MoEDeploymentStatus(ApiModel):
    """Observed state, written by the operator."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    observed_generation: int | None = Field(default=None, description="Last spec generation reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing and Degraded.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    endpoint: str | None = Field(default=None, description="Base URL of the OpenAI-compatible API.")
    ray_service: str | None = Field(default=None, description="Name of the RayService this object owns (ray.mode KubeRay).")
    ray_address: str | None = Field(default=None, description="Dashboard URL of the Ray cluster the application was "
                                    "deployed to (ray.mode Existing). A spec that names another cluster, or the other "
                                    "mode, is refused while it is set (Ready=False, InvalidSpec): the application "
                                    "keeps serving where it is; delete the object to remove it, then create it anew.")
    replicas: int = Field(default=0, description="Ready replicas per shard group (the least across groups); the scale subresource reads it.")
    selector: str = Field(default="", description="Label selector of the Ray worker Pods (scale subresource) with mode "
                          "KubeRay; unset with mode Existing, whose replicas run as Ray actors in Pods the operator "
                          "does not own or label.")
    groups: list[GroupStatus] = Field(default_factory=list, description="Per shard group.")
    tiers: dict[str, TierSummary] = Field(default_factory=dict, description="Residency per tier (hot, warm, cold).")
    overridden_experts: int = Field(default=0, description="Experts serving an override.")
    quarantined_experts: list[ExpertIdStr] | None = Field(
        default=None, max_length=4096,
        description="Experts the Ingress' routers leave out now (spec.routing.quarantine once applied).")
    routing_anomalies: list[RoutingAnomalyRecord] | None = Field(
        default=None, max_length=20, description="The routing anomaly detector's alerts now (condition RoutingAnomaly).")
    auto_quarantined: list[ExpertIdStr] | None = Field(
        default=None, max_length=4096,
        description="Experts quarantined on a routing anomaly (spec.routing.autoQuarantine), on top of "
        "spec.routing.quarantine.")
    auto_quarantine_refused: list[ExpertIdStr] | None = Field(
        default=None, max_length=4096,
        description="Surging experts spec.routing.autoQuarantine left serving: quarantining them would pass "
        "maxQuarantinedShare or leave a layer too few candidates.")
    capacity_factor: float | None = Field(
        default=None, description="The expert capacity the Ingress' routers apply now (spec.routing.capacityFactor "
                                  "once applied; unset: exact routing). Tokens routed to their next choice are "
                                  "counted by the metric moe_capacity_rerouted_tokens.")
    imbalance: float | None = Field(
        default=None, description="Mean over MoE layers of each layer's max/mean shard-group load over the last window "
                                  "(a decode step waits, layer by layer, for that layer's busiest group).")
    worst_layer: LayerImbalance | None = Field(default=None, description="The least balanced layer.")
    last_swaps: list[SwapRecord] = Field(default_factory=list, max_length=20, description="Most recent hot-swaps, newest first.")
    autoscaling: AutoscalingStatus | None = Field(default=None, description="Last autoscaling decision.")
    api_keys: ApiKeysStatus | None = Field(default=None, description="API keys in force (spec.ingress.apiKeySecretRef).")
    kv_cache: KVCacheStatus | None = Field(default=None, description="The Ingress' KV cache blocks, prefix cache hits, "
                                           "preemptions and chunked prefills.")


class MoEDeployment(ApiModel):
    """A whole object, as read from a manifest or the API."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    api_version: Literal["serving.moe.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["MoEDeployment"]
    metadata: dict = Field(default_factory=dict)
    spec: MoEDeploymentSpec
    status: MoEDeploymentStatus | None = None
