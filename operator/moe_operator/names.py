"""Every name, label and annotation the operator owns or reads, in one place (pure).

A MoEDeployment `NS/NAME` becomes the Serve application `NS.NAME` on a shared Ray cluster, or,
with ray.mode KubeRay, the RayService `NS/NAME` (labelled and annotated here), whose Serve proxy
KubeRay exposes as the Service `NAME-serve-svc`. Tests spell these strings out on purpose: they
are the contract users and their tools see.
"""

from __future__ import annotations

from moe_operator.api.models import GROUP

MANAGED_BY = "moe-operator"  # app.kubernetes.io/managed-by on what the operator creates

# on a MoEDeployment
FINALIZER = f"{GROUP}/cleanup"  # held until the Serve application or RayService is gone
REBALANCE_ANNOTATION = f"{GROUP}/rebalance-requested"  # `moectl rebalance`; answered in status.autoscaling.lastRequest
MANIFEST_ANNOTATION = f"{GROUP}/manifest"  # standalone: the manifest file `moectl up` serves
OWNER_ANNOTATION = f"{GROUP}/moectl-up"  # standalone: "<pid>:<process start time>" of the `moectl up` serving it

# on a RayService (ray.mode KubeRay)
MOEDEPLOYMENT_LABEL = f"{GROUP}/moedeployment"  # the MoEDeployment's name; on the RayService and its Pods
RENDERED_SPEC_ANNOTATION = f"{GROUP}/rendered-spec"  # digest of the spec we wrote: rewrite only on a change


def app_name(namespace: str, name: str) -> str:
    """Serve application name: unique per MoEDeployment on a shared Ray cluster."""
    return f"{namespace}.{name}"


def serve_service(namespace: str, name: str) -> str:
    """The cluster DNS name of the Service KubeRay puts in front of a RayService's Serve proxy."""
    return f"{name}-serve-svc.{namespace}.svc"


def worker_selector(name: str) -> str:
    """Label selector of a RayService's worker Pods (the scale subresource's status.selector)."""
    return f"{MOEDEPLOYMENT_LABEL}={name},ray.io/node-type=worker"
