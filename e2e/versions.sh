# Versions the end-to-end test builds and runs. The sidecar versions are read
# from deploy/ so that the test always runs exactly what the manifests pin.
# shellcheck shell=bash
E2E_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

KUBERNETES_VERSION=v1.36.1
ETCD_VERSION=v3.6.5
HELM_VERSION=$(sed -n 's/^HELM_VERSION="\(.*\)".*/\1/p' "$E2E_ROOT/deploy/validate.sh")

# image tag pinned in deploy/ for a sidecar, e.g. pinned_tag csi-provisioner
pinned_tag() {
    grep -rhoE "registry.k8s.io/sig-storage/$1:v[0-9.]+" "$E2E_ROOT/deploy/overlays" \
        | sort -u | sed 's/.*://' | head -1
}
PROVISIONER_VERSION=$(pinned_tag csi-provisioner)
ATTACHER_VERSION=$(pinned_tag csi-attacher)
RESIZER_VERSION=$(pinned_tag csi-resizer)
SNAPSHOTTER_VERSION=$(pinned_tag csi-snapshotter)

E2E_CACHE=${EXAMPLE_CSI_E2E_CACHE:-$HOME/.cache/example-csi-e2e}
