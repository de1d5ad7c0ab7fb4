# shellcheck shell=bash
# Images for the node, built here from the project's own files with Debian's tools (no registry,
# no Docker engine), cached by a hash of their inputs (sourced by scripts/testenv):
#
#   localhost/moe-operator/pause:3.2       the sandbox image: the kubelet's pause.c, static
#   localhost/moe-operator/base:bookworm-H  debootstrap'd Debian bookworm with python3 and pip,
#                                          shaped like python:3.11-slim (pip installs to /usr/local)
#   localhost/moe-operator/operator:H       the root Dockerfile on that base
#   localhost/moe-operator/ray:H            images/ray.Dockerfile on that base: Ray, torch (PyPI's
#                                          build, the same wheel the venv takes), the project's workers
#   localhost/moe-operator/kuberay:vV       KubeRay's ray-operator (built by testenv.d/build.sh, static),
#                                          alone in the image, as KubeRay's own image runs it
#
# buildah runs the Dockerfiles (chroot isolation, host network for PyPI); its storage lives in the
# cache. Images are imported into the node's containerd, whose root is in the cache too, so a warm
# start imports nothing.

PAUSE_IMAGE=localhost/moe-operator/pause:3.2
IMAGES="$CACHE/images"
BUILDAH_RUN="$CACHE/buildah-run"
DEBIAN_MIRROR=${MOE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_PACKAGES=python3,python3-pip,ca-certificates,procps,wget  # wget: KubeRay's probes run it

install_image_tools() {
  apt_install buildah debootstrap skopeo gcc libc6-dev
}

bah() { as_root buildah --root "$CACHE/buildah" --runroot "$BUILDAH_RUN" --storage-driver overlay "$@"; }

inputs_hash() { # paths... -> short sha256 of their content (files in git's view when in a checkout)
  (cd "$REPO" && {
    for p in "$@"; do
      if [ -d "$p" ]; then find "$p" -type f -not -name '*.pyc' -not -path '*/__pycache__/*' -not -path '*.egg-info*' | sort
      else echo "$p"; fi
    done | while read -r f; do echo "$f"; sha256sum <"$f"; done
  } | sha256sum | cut -c1-12)
}

image_present() { ctr_ images ls -q 2>/dev/null | grep -qx "$1"; }

import_archive() { # docker-archive tar
  ctr_ images import --no-unpack=false "$1" >/dev/null || die "ctr import of $1 failed"
}

images_import_pause() {
  image_present "$PAUSE_IMAGE" && return 0
  local work="$IMAGES/pause"; rm -rf "$work"; mkdir -p "$work"
  [ -x "$BIN/pause" ] || die "pause not built; run: scripts/testenv install"
  local c; c=$(bah from scratch)
  bah copy "$c" "$BIN/pause" /pause >/dev/null
  bah config --entrypoint '["/pause"]' --user 65535:65535 "$c"
  bah commit -q "$c" "$PAUSE_IMAGE" >/dev/null; bah rm "$c" >/dev/null
  bah push -q "$PAUSE_IMAGE" "docker-archive:$work/pause.tar:$PAUSE_IMAGE" >/dev/null
  import_archive "$work/pause.tar"; rm -rf "$work"
}

base_image() { # -> name of the base image in buildah's storage (built once per package list)
  local tag; tag=bookworm-$(echo "$BASE_PACKAGES $DEBIAN_MIRROR v1" | sha256sum | cut -c1-12)
  local name=localhost/moe-operator/base:$tag
  if ! bah inspect --type image "$name" >/dev/null 2>&1; then
    log "debootstrap bookworm ($BASE_PACKAGES) for the images' base (about a minute, once)"
    local root="$IMAGES/rootfs"; as_root rm -rf "$root"; mkdir -p "$IMAGES"
    as_root debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$root" "$DEBIAN_MIRROR" \
      >"$IMAGES/debootstrap.log" 2>&1 || { tail -n 20 "$IMAGES/debootstrap.log" >&2; die "debootstrap failed"; }
    # like python:3.11-slim: pip may install system-wide, into /usr/local
    as_root rm -rf "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/* \
      "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/lib/python3.11/EXTERNALLY-MANAGED
    as_root ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
    local c m; c=$(bah from scratch); m=$(bah mount "$c")
    as_root cp -a "$root/." "$m/"
    bah umount "$c" >/dev/null
    bah config --env PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin --env LANG=C.UTF-8 \
      --cmd '["python3"]' "$c"
    bah commit -q "$c" "$name" >/dev/null; bah rm "$c" >/dev/null
    as_root rm -rf "$root"
  fi
  echo "$name"
}

bud_image() { # name dockerfile inputs... -> ref: buildah bud on the base (cached by the inputs' hash)
  local name=$1 file=$2; shift 2
  local ref; ref=$name:$(inputs_hash "$file" "$@")
  if ! bah inspect --type image "$ref" >/dev/null 2>&1; then
    local base; base=$(base_image)
    log "building $ref from $file (minutes, once per change of its inputs)"
    local wheels=() d logf; logf="$IMAGES/build-$(basename "$name").log"
    for d in ${PIP_FIND_LINKS:-}; do [ -d "$d" ] && wheels+=(--volume "$d:$d:ro"); done
    (cd "$REPO" && bah bud --isolation chroot --network host --pull-never --layers \
      --build-arg "BASE=$base" --build-arg "PIP_FIND_LINKS=${PIP_FIND_LINKS:-}" --build-arg TORCH_INDEX= \
      --volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro "${wheels[@]}" \
      -f "$file" -t "$ref" . >"$logf" 2>&1) || { tail -n 30 "$logf" >&2; die "building $ref failed (log: $logf)"; }
    local old; for old in $(bah images --format '{{.Name}}:{{.Tag}}' | grep "^$name:" | grep -vx "$ref"); do
      bah rmi "$old" >/dev/null 2>&1 || true   # earlier builds of the same image
    done
  fi
  echo "$ref"
}

import_image() { # ref: into the node's containerd, unless there already (MOE_TESTENV_REIMPORT=1: again)
  if [ "${MOE_TESTENV_REIMPORT:-0}" = 1 ] && image_present "$1"; then ctr_ images rm "$1" >/dev/null; fi
  image_present "$1" && return 0
  local tar; tar="$IMAGES/import-$$.tar"
  bah push -q "$1" "docker-archive:$tar:$1" >/dev/null
  import_archive "$tar"; rm -f "$tar"
  # earlier builds of the same image leave the store (the Ray image is about 6 GB a version)
  local old; for old in $(ctr_ images ls -q | grep "^${1%:*}:" | grep -vx "$1"); do
    ctr_ images rm --sync "$old" >/dev/null 2>&1 || true
  done
}

OPERATOR_IMAGE_INPUTS="Dockerfile pyproject.toml operator workers"  # README.md: package metadata only
RAY_IMAGE_INPUTS="images/ray.Dockerfile pyproject.toml operator workers"

KUBERAY_IMAGE=localhost/moe-operator/kuberay:v$KUBERAY_VERSION

kuberay_image() { # the operator binary alone, run as a non-root user
  bah inspect --type image "$KUBERAY_IMAGE" >/dev/null 2>&1 && return 0
  [ -x "$KUBERAY_DIR/bin/ray-operator" ] || die "ray-operator not built; run: scripts/testenv install"
  local c; c=$(bah from scratch)
  bah copy "$c" "$KUBERAY_DIR/bin/ray-operator" /manager >/dev/null
  bah config --entrypoint '["/manager"]' --user 65532:65532 "$c"
  bah commit -q "$c" "$KUBERAY_IMAGE" >/dev/null; bah rm "$c" >/dev/null
}

images_prebuild() {
  mkdir -p "$IMAGES"
  # shellcheck disable=SC2086
  bud_image localhost/moe-operator/operator $OPERATOR_IMAGE_INPUTS >/dev/null
  # shellcheck disable=SC2086
  bud_image localhost/moe-operator/ray $RAY_IMAGE_INPUTS >/dev/null
  kuberay_image
}

images_import() { # -> env lines naming the images (containerd must run)
  local op ray
  # shellcheck disable=SC2086
  op=$(bud_image localhost/moe-operator/operator $OPERATOR_IMAGE_INPUTS)
  # shellcheck disable=SC2086
  ray=$(bud_image localhost/moe-operator/ray $RAY_IMAGE_INPUTS)
  kuberay_image
  import_image "$op"; import_image "$ray"; import_image "$KUBERAY_IMAGE"
  echo "export MOE_OPERATOR_IMAGE=$op"
  echo "export MOE_RAY_IMAGE=$ray"
  echo "export MOE_KUBERAY_IMAGE=$KUBERAY_IMAGE"
}
