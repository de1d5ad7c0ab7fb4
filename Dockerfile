# The operator image (what helm/moe-operator runs). The operator only renders and applies: it needs
# no torch and no Ray, so it installs the package without its data-plane dependencies.
#   docker build -t ghcr.io/moe-operator/moe-operator:0.1.0 .
# scripts/testenv builds it with buildah on a debootstrap'd Debian bookworm base (BASE).
ARG BASE=python:3.11-slim
FROM ${BASE}
# dependencies first: a change of the project's code rebuilds only the last layer
RUN pip install --no-cache-dir "kopf==1.45.2" "kubernetes==37.0.2" "pydantic==2.14.4" "PyYAML==6.0.4" \
      "prometheus-client==0.26.0" "typer==0.29.2" "rich==15.0.0" "requests==2.34.2"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator operator
COPY workers workers
RUN pip install --no-cache-dir --no-deps . && rm -rf /src
WORKDIR /
USER 65532:65532
# USER: kopf names itself after the login (getpass), and uid 65532 has no passwd entry; without
# it the operator exits at start with "getpwuid(): uid not found" (seen on the test node)
ENV HOME=/tmp PYTHONUNBUFFERED=1 USER=moe-operator
ENTRYPOINT ["kopf", "run", "-m", "moe_operator.handlers.operator"]
CMD ["--standalone", "--all-namespaces"]
